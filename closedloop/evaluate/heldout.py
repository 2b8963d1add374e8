"""Held-out evaluation of one policy manifest with the scaffold locked (docs/concepts.md,
held-out evaluation).

Each task gets ``attempts`` episodes, attempt k with seed ``seeds[k]``. Per task, c successes of
n scored attempts give pass@1 = c/n, pass@k (unbiased) and pass^k (all k succeed, τ-bench).
Censored or quarantined attempts are unscored: they are counted in the termination distribution
and excluded from n, never scored 0.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from closedloop.contracts import Episode
from closedloop.errors import EmptySampleError, MixedPolicyGroupError
from closedloop.evaluate.stats import (
    bootstrap_mean_ci,
    pass_at_k,
    pass_hat_k,
    shared_task_comparison,
)


@dataclass(frozen=True)
class TaskOutcome:
    """One task's scored attempts."""

    task_id: str
    family: str
    n: int
    successes: int
    unscored: int


@dataclass(frozen=True)
class EvalSummary:
    """Held-out metrics of one policy on one task set."""

    policy_version: str
    manifest_hash: str
    tasks: tuple[TaskOutcome, ...]
    k: int
    pass_at_1: float | None
    pass_at_1_ci: tuple[float, float] | None
    pass_at_k: float | None
    pass_hat_k: float | None
    invalid_action_rate: float | None
    mean_tool_calls: float | None
    mean_action_tokens: float | None
    mean_latency_s: float | None
    side_effect_rate: float | None
    termination: dict[str, int] = field(default_factory=dict)
    episodes: int = 0

    def per_task_success(self) -> dict[str, float]:
        """Task id -> success rate over scored attempts (tasks with none are left out)."""
        return {t.task_id: t.successes / t.n for t in self.tasks if t.n > 0}

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        out = dict(self.__dict__)
        out["tasks"] = [t.__dict__ for t in self.tasks]
        return out


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize_eval(episodes: Sequence[Episode], k: int = 3, seed: int = 0) -> EvalSummary:
    """Reduce evaluation episodes (one policy) to held-out metrics."""
    if not episodes:
        raise EmptySampleError("no evaluation episodes")
    versions = {ep.trajectory.behavior_policy_version for ep in episodes}
    manifests = {ep.trajectory.policy_manifest_hash for ep in episodes}
    if len(versions) != 1 or len(manifests) != 1:
        raise MixedPolicyGroupError(f"evaluation mixes policies: {sorted(versions)}")
    by_task: dict[str, list[Episode]] = {}
    for ep in episodes:
        by_task.setdefault(ep.trajectory.task_id, []).append(ep)
    outcomes = []
    for task_id, eps in sorted(by_task.items()):
        scored = [e.trajectory.task_success for e in eps if e.trajectory.task_success is not None]
        outcomes.append(
            TaskOutcome(
                task_id,
                eps[0].trajectory.task_family,
                len(scored),
                int(sum(1 for s in scored if s >= 1.0)),
                len(eps) - len(scored),
            )
        )
    rates = [o.successes / o.n for o in outcomes if o.n > 0]
    ci = bootstrap_mean_ci(rates, seed=seed) if len(rates) >= 2 else None
    at_k = [pass_at_k(o.n, o.successes, k) for o in outcomes if o.n >= k]
    hat_k = [pass_hat_k(o.n, o.successes, k) for o in outcomes if o.n >= k]
    actions = [t for ep in episodes for t in ep.turns]
    rewards = [ep.trajectory.reward for ep in episodes if ep.trajectory.reward is not None]
    side = [
        1.0 if r.get("collateral_damage", 0) > 0 or r.get("policy_violation", 0) > 0 else 0.0
        for r in rewards
    ]
    return EvalSummary(
        policy_version=versions.pop(),
        manifest_hash=manifests.pop(),
        tasks=tuple(outcomes),
        k=k,
        pass_at_1=_mean(rates),
        pass_at_1_ci=None if ci is None else (ci.lo, ci.hi),
        pass_at_k=_mean(at_k),
        pass_hat_k=_mean(hat_k),
        invalid_action_rate=_mean([1.0 if t.action_kind == "invalid" else 0.0 for t in actions]),
        mean_tool_calls=_mean(
            [float(sum(1 for t in ep.turns if t.action_kind == "tool")) for ep in episodes]
        ),
        mean_action_tokens=_mean([float(ep.trajectory.num_action_tokens) for ep in episodes]),
        mean_latency_s=_mean(
            [
                sum(v for key, v in ep.trajectory.timings.items() if key.endswith("_s"))
                for ep in episodes
            ]
        ),
        side_effect_rate=_mean(side),
        termination=dict(Counter(ep.trajectory.termination.value for ep in episodes)),
        episodes=len(episodes),
    )


def paired_difference(a: EvalSummary | None, b: EvalSummary | None, seed: int,
                      what: str, n_boot: int | None = None) -> dict[str, Any]:
    """Paired bootstrap CI of per-task success ``a - b`` over the tasks scored in both
    (``measured`` False, with the reason, when an evaluation is missing, fewer than 2 tasks
    are common, or every attempt of both failed — or every one succeeded: ``no_signal``, see
    ``closedloop.evaluate.stats.uniform_outcome``); ``what`` names the comparison."""
    if a is None or b is None:
        return {"what": what, "measured": False, "detail": "an evaluation is missing"}
    pair = shared_task_comparison(a.per_task_success(), b.per_task_success(), seed=seed,
                                  **({} if n_boot is None else {"n_boot": n_boot}))
    if pair.tasks < 2:
        return {"what": what, "measured": False, "tasks": pair.tasks,
                "detail": f"{pair.tasks} tasks scored in both evaluations (need 2)"}
    if pair.ci is None:
        return {"what": what, "measured": False, "tasks": pair.tasks,
                "no_signal": pair.no_signal,
                "detail": f"every attempt on both sides {pair.no_signal} over {pair.tasks} "
                          "tasks: no signal to compare"}
    ci = pair.ci
    return {"what": what, "measured": True, "tasks": pair.tasks, "estimate": ci.estimate,
            "ci": [ci.lo, ci.hi], "n_boot": ci.n_boot, "alpha": ci.alpha}
