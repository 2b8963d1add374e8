"""Session fixtures shared by the run-level tests: the tiny agent (taught once per session)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

SUITE_CPU_FLAGS = "fpu sse2 avx avx2 fma"
"""The precision policy resolves ``training.precision: auto`` from the host's CPU flags; the
suite plays one host class (no native bf16, so ``auto`` is float32) on every CPU, subprocesses
included, so its runs compute alike everywhere. Tests of the policy inject facts of their own."""
os.environ["CLOSEDLOOP_CPU_FLAGS"] = SUITE_CPU_FLAGS

TRAIN_TASKS, HELDOUT_TASKS, SEED = 2, 2, 0
"""The task sets the tiny agent is taught on (and every run that uses it trains on)."""


@pytest.fixture(scope="session")
def tiny_agent_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama that solves the two train tasks about half the time (tests.tiny_agent),
    saved as a local model folder a run config's ``model:`` accepts."""
    from closedloop.envs.terminal.task_sets import build_task_sets
    from tests.tiny_agent import build_tiny_agent

    sets = build_task_sets(TRAIN_TASKS, HELDOUT_TASKS, seed=SEED)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        agent = build_tiny_agent(tmp_path_factory.mktemp("tiny-agent") / "model",
                                 sets.train_ids, sets.heldout_ids, seed=SEED)
    finally:
        torch.set_num_threads(threads)
    assert agent.mixed_tasks, f"the tiny agent never both solves and fails: {agent.outcomes}"
    return agent.folder


def short_run_config(model_dir: Path, rl_steps: int) -> dict[str, object]:
    """A short tiny-agent run: 2 train tasks, ``rl_steps`` steps of 2 groups x 4 siblings, no
    SFT, no retain suites, only the start and final held-out evaluations."""
    return {
        "model": str(model_dir),
        "environment": {"train_tasks": TRAIN_TASKS, "heldout_tasks": HELDOUT_TASKS,
                        "max_turns": 6},
        "rollout": {"group_size": 4, "max_action_tokens": 64, "temperature": 1.0},
        "credit": {"censor_rule": "drop_censored"},
        "evaluation": {"attempts_per_task": 1, "retain_suites": [], "curve_points": 2,
                       "environment_family_disjoint": False, "cold_start_train_eval": False},
        "training": {"rl_steps": rl_steps, "groups_per_step": 2, "learning_rate": 1e-3,
                     "seed": SEED, "package_check": "quick"},
        "sft": {"enabled": False},
    }


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray cluster for the test session: 2 CPUs, a 100 MB object store, no dashboard
    (skipped, naming why, where ray is not installed)."""
    from closedloop.rollout.ray_workers import RayWorkersConfig, ray_cluster, ray_unavailable_reason

    reason = ray_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with ray_cluster(RayWorkersConfig(num_cpus=2, object_store_mb=100)) as resources:
        yield resources
