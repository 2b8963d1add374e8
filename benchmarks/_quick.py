"""The quick workload of the benchmarks' ``--quick`` checks: the tests' tiny agent
(``tests/tiny_agent.py``: coin-flip competence on its 2 train tasks, taught to give up on its 2
held-out ones) on the tests' short run (``tests/conftest.py``), so a check ends episodes, scores
them and trains in seconds where the raw embedded model would leave every episode censored."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
QUICK_TASKS = (2, 2)
"""Train / held-out tasks of the quick workload (the tiny agent is taught on these)."""


def quick_config(model_dir: Path, steps: int) -> dict[str, Any]:
    """The tests' short tiny-agent run (tests/conftest.py short_run_config) with ``steps``."""
    train, heldout = QUICK_TASKS
    return {
        "model": str(model_dir),
        "environment": {"train_tasks": train, "heldout_tasks": heldout, "max_turns": 6},
        "rollout": {"group_size": 4, "max_action_tokens": 64, "temperature": 1.0},
        "credit": {"censor_rule": "drop_censored"},
        "evaluation": {"attempts_per_task": 1, "retain_suites": [], "curve_points": 2,
                       "environment_family_disjoint": False, "cold_start_train_eval": False},
        "training": {"rl_steps": steps, "groups_per_step": 2, "learning_rate": 1e-3,
                     "seed": 0, "package_check": "quick"},
        "sft": {"enabled": False},
        "update": {"objective": "ppo_clip", "proximal_policy": "trainer_at_step_start",
                   "reference_policy": "initial"},
    }


def build_quick_model(root: Path) -> Path:
    """The tests' tiny agent, taught and saved under ``root``; its folder."""
    sys.path.insert(0, str(REPO))  # the repository root: tests.tiny_agent
    from closedloop.envs.terminal.task_sets import build_task_sets
    from tests.tiny_agent import build_tiny_agent

    sets = build_task_sets(*QUICK_TASKS, seed=0)
    agent = build_tiny_agent(root / "tiny-agent", sets.train_ids, sets.heldout_ids, seed=0)
    return Path(agent.folder)
