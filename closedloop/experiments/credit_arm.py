"""The optional credit arm of a controlled experiment (``credit.experiment_arm``; credit
estimators by name, docs/credit.md).

With ``credit.experiment_arm: branching`` (or ``gae``) the experiment also trains an arm of that
name: the rloo arm's loop, budgets, cold start (copied, not retrained) and evaluation, with
that ``credit.estimator`` (and ``environment.branching: true`` for branching). Its held-out success
is reported with its paired difference from the frozen start and from the rloo arm, and every
trained arm's entry carries its **compute** from its metrics (:func:`arm_compute`): steps,
collected and trained episodes and action tokens, branch continuations and their own turns and
action tokens, and seconds spent collecting, branching and updating.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from closedloop.config import RunConfig
from closedloop.errors import ConfigError

__all__ = ["OPTIONAL_ARMS", "arm_compute", "credit_arm_config"]

OPTIONAL_ARMS = ("branching", "gae")
"""Arms an experiment trains only when ``credit.experiment_arm`` names them."""


def credit_arm_config(cfg: RunConfig) -> RunConfig:
    """The credit arm's config: the experiment's, with the estimator of ``experiment_arm``,
    the environment's forks on, and the held-out curve reduced to start and final (the
    learning curve is the rloo arm's)."""
    name = cfg.credit.experiment_arm
    if name == "none":
        raise ConfigError("credit.experiment_arm", "no credit arm to train")
    return replace(cfg, credit=replace(cfg.credit, estimator=name, reward_control="none"),
                   environment=replace(cfg.environment, branching=name == "branching"),
                   evaluation=replace(cfg.evaluation, curve_points=2))


def arm_compute(run_dir: Path, group_size: int) -> dict[str, Any]:
    """What an arm's RL steps spent, summed over its ``rl_step`` metrics records."""
    steps = [r for r in (json.loads(line) for line in
                         (run_dir / "metrics.jsonl").read_text().splitlines())
             if r.get("kind") == "rl_step"]
    seconds: dict[str, float] = {}
    branch = {"sets": 0, "continuations": 0, "turns": 0, "action_tokens": 0}
    for r in steps:
        for k, v in (r.get("seconds") or {}).items():
            seconds[k] = seconds.get(k, 0.0) + float(v)
        for k in branch:
            branch[k] += int(((r.get("credit") or {}).get("branch") or {}).get(k) or 0)
    metrics = [r.get("metrics") or {} for r in steps]
    return {
        "steps": len(steps),
        "estimators": sorted({str((r.get("credit") or {}).get("estimator")) for r in steps}),
        "collected_episodes": sum(int(r.get("groups") or 0) for r in steps) * group_size,
        "trained_episodes": sum(int(m.get("batch/n_episodes") or 0) for m in metrics),
        "trained_action_tokens": sum(int(m.get("batch/n_action_tokens") or 0) for m in metrics),
        "branches": branch, "seconds": seconds, "seconds_total": sum(seconds.values())}
