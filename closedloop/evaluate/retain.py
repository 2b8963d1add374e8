"""Retain evaluation: per-suite summaries and the retain delta.

A package's retain suites (``EnvPackage.retain_tasks``; the terminal tasks': base tool use,
instruction following and safety refusals) are frozen, family-disjoint probes. A run evaluates
them at the start and at fixed intervals with the same attempts and seeds as the held-out set,
and reports per suite

    before = mean_t s₀(t),   after = mean_t s₁(t),   Δ = mean_t [s₁(t) − s₀(t)]

over the tasks t scored at both points (s = a task's success rate over its scored attempts),
with a paired percentile-bootstrap interval for Δ that resamples tasks
(``closedloop.evaluate.stats.paired_bootstrap_ci``). A suite *regressed significantly* when the
interval's upper end is below 0; ``RetainDelta.breaches(limit)`` names the suites whose Δ fell
below a preregistered −limit (stop or roll back).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from closedloop.contracts import Episode
from closedloop.contracts.package import EnvPackage
from closedloop.errors import EnvPackageError, RetainSuiteMismatchError
from closedloop.evaluate.heldout import EvalSummary, summarize_eval
from closedloop.evaluate.stats import paired_bootstrap_ci, uniform_outcome


class SuiteScores(Protocol):
    """Anything with per-task success rates, e.g. ``EvalSummary``."""

    def per_task_success(self) -> dict[str, float]:
        """Task id -> success rate over scored attempts."""
        ...


def retain_suite_tasks(package: EnvPackage, suites: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Each named retain suite's task ids, in ``suites`` order (the package's
    ``retain_tasks``; ``EnvPackageError`` when it has none)."""
    if package.retain_tasks is None:
        raise EnvPackageError(f"environment package {package.env_id!r} has no retain suites "
                              f"(asked for {list(suites)}); set evaluation.retain_suites: []")
    return {name: tuple(package.retain_tasks((name,))) for name in suites}


def split_by_suite(episodes: Sequence[Episode],
                   suites: Mapping[str, Sequence[str]]) -> dict[str, list[Episode]]:
    """Group retain episodes by suite (``suites``: name -> task ids), in ``suites`` order;
    ``RetainSuiteMismatchError`` for an episode of a task no suite holds."""
    owner = {task: name for name, tasks in suites.items() for task in tasks}
    out: dict[str, list[Episode]] = {}
    for ep in episodes:
        name = owner.get(ep.trajectory.task_id)
        if name is None:
            raise RetainSuiteMismatchError(f"{ep.trajectory.task_id!r} is in none of the retain "
                                           f"suites {list(suites)}")
        out.setdefault(name, []).append(ep)
    return {name: out[name] for name in suites if name in out}


def summarize_suites(episodes: Sequence[Episode], suites: Mapping[str, Sequence[str]],
                     k: int = 3, seed: int = 0) -> dict[str, EvalSummary]:
    """One ``EvalSummary`` per retain suite present in ``episodes`` (one policy)."""
    return {suite: summarize_eval(eps, k=k, seed=seed)
            for suite, eps in split_by_suite(episodes, suites).items()}


@dataclass(frozen=True)
class SuiteDelta:
    """One suite's success before and after, over the tasks scored at both points.

    delta = after − before = mean_t [s₁(t) − s₀(t)]; (ci_lo, ci_hi) its paired bootstrap
    interval at level 1 − alpha; all ``None`` when no task was scored at both points.
    n_unpaired: tasks scored at only one of the two points (left out of every number).
    """

    suite: str
    n_paired: int
    n_unpaired: int
    before: float | None
    after: float | None
    delta: float | None
    ci_lo: float | None
    ci_hi: float | None
    alpha: float

    no_signal: str | None = None  # "failed"/"succeeded": every attempt at both points did

    @property
    def significant_regression(self) -> bool:
        """The whole interval lies below 0."""
        return self.ci_hi is not None and self.ci_hi < 0.0

    @property
    def measured(self) -> bool:
        """Whether the suite could show a change: tasks scored at both points, and not every
        attempt at both failed (nothing could regress) or succeeded (nothing could gain)."""
        return self.n_paired > 0 and self.no_signal is None


@dataclass(frozen=True)
class RetainDelta:
    """Per-suite retain deltas between two evaluations (start vs final)."""

    suites: tuple[SuiteDelta, ...]
    n_boot: int
    seed: int

    def breaches(self, limit: float) -> tuple[str, ...]:
        """Suites whose Δ is below −``limit`` (a preregistered regression frontier)."""
        return tuple(s.suite for s in self.suites if s.delta is not None and s.delta < -limit)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (one entry per suite, with ``significant_regression``)."""
        return {"n_boot": self.n_boot, "seed": self.seed,
                "suites": {s.suite: {**s.__dict__,
                                     "significant_regression": s.significant_regression,
                                     "measured": s.measured}
                           for s in self.suites}}


def _suite_delta(suite: str, before: Mapping[str, float], after: Mapping[str, float],
                 n_boot: int, seed: int, alpha: float) -> SuiteDelta:
    common = sorted(set(before) & set(after))
    unpaired = len(set(before) ^ set(after))
    if not common:
        return SuiteDelta(suite, 0, unpaired, None, None, None, None, None, alpha)
    b = {t: before[t] for t in common}
    a = {t: after[t] for t in common}
    ci = paired_bootstrap_ci(a, b, n_boot, seed=seed, alpha=alpha)
    return SuiteDelta(suite, len(common), unpaired, sum(b.values()) / len(b),
                      sum(a.values()) / len(a), ci.estimate, ci.lo, ci.hi, alpha,
                      uniform_outcome(b, a))


def retain_delta(start: Mapping[str, SuiteScores], final: Mapping[str, SuiteScores], *,
                 n_boot: int = 2000, seed: int = 0, alpha: float = 0.05) -> RetainDelta:
    """Per-suite Δ = final − start with paired bootstrap CIs (see the module docstring).

    ``start`` and ``final`` map suite name -> per-suite summary (``summarize_suites``) and must
    name the same suites (``RetainSuiteMismatchError`` otherwise).
    """
    if set(start) != set(final):
        raise RetainSuiteMismatchError(f"suites differ: start {sorted(start)}, final "
                                       f"{sorted(final)}")
    return RetainDelta(tuple(_suite_delta(s, start[s].per_task_success(),
                                          final[s].per_task_success(), n_boot, seed, alpha)
                             for s in start), n_boot, seed)


__all__ = [
    "RetainDelta", "RetainSuiteMismatchError", "SuiteDelta", "SuiteScores", "retain_delta",
    "retain_suite_tasks", "split_by_suite", "summarize_suites",
]
