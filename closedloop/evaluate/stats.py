"""Evaluation statistics: pass@k, pass^k, bootstrap intervals and (from ``closedloop.intervals``)
Wilson intervals.

Pure functions over counts and numbers (stdlib + numpy, no torch).

- pass@k (search capacity): probability that at least one of k attempts succeeds; the unbiased
  estimator from n attempts with c successes is 1 - C(n-c, k) / C(n, k).
- pass^k (reliability, τ-bench): probability that all k attempts succeed; the unbiased estimator
  is C(c, k) / C(n, k).

Both assume the n attempts are exchangeable draws with the policy, scaffold and budget fixed.
Hand-worked: n=3, c=1, k=3 -> pass@3 = 1, pass^3 = 0; n=5, c=2, k=2 -> pass@2 = 1 - 3/10 = 0.7,
pass^2 = 1/10 = 0.1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple, cast

import numpy as np

from closedloop.errors import EmptySampleError, StatsInputError
from closedloop.intervals import wilson_interval

__all__ = [
    "BootstrapCI",
    "EmptySampleError",
    "SharedTaskComparison",
    "StatsInputError",
    "bootstrap_mean_ci",
    "paired_bootstrap_ci",
    "pass_at_k",
    "pass_hat_k",
    "shared_task_comparison",
    "uniform_outcome",
    "wilson_interval",
]


PerTask = Mapping[str, float] | Sequence[float] | np.ndarray
"""Per-task scores: a mapping keyed by task id, or a 1-D sequence aligned by position."""


class BootstrapCI(NamedTuple):
    """A point estimate and a two-sided percentile-bootstrap interval at level 1 - alpha."""

    estimate: float
    lo: float
    hi: float
    n: int
    n_boot: int
    alpha: float


def _check_counts(n: int, c: int, k: int) -> None:
    if n < 1:
        raise EmptySampleError(f"need n >= 1 attempts, got n={n}")
    if not 0 <= c <= n:
        raise StatsInputError(f"need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise StatsInputError(f"need 1 <= k <= n, got k={k}, n={n}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n attempts with c successes: 1 - C(n-c, k) / C(n, k).

    Exact integer binomials (``math.comb`` is 0 when n-c < k, giving 1.0).
    """
    _check_counts(n, c, k)
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_hat_k(n: int, c: int, k: int) -> float:
    """Unbiased pass^k (all k attempts succeed) from n attempts with c successes: C(c,k)/C(n,k)."""
    _check_counts(n, c, k)
    return math.comb(c, k) / math.comb(n, k)


def _check_bootstrap(n: int, n_boot: int, alpha: float) -> None:
    if n < 1:
        raise EmptySampleError("bootstrap needs at least one observation")
    if n_boot < 1:
        raise StatsInputError(f"n_boot must be >= 1, got {n_boot}")
    if not 0.0 < alpha < 1.0:
        raise StatsInputError(f"alpha must lie in (0, 1), got {alpha}")


def _percentile_ci(values: np.ndarray, n_boot: int, seed: int, alpha: float) -> BootstrapCI:
    """Resample ``values`` with replacement n_boot times; percentile interval of the means."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, values.size, size=(n_boot, values.size))
    means = values[idx].mean(axis=1)
    lo, hi = np.quantile(means, [alpha / 2.0, 1.0 - alpha / 2.0])
    return BootstrapCI(float(values.mean()), float(lo), float(hi), values.size, n_boot, alpha)


def _as_finite_array(values: Sequence[float] | np.ndarray, name: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1:
        raise StatsInputError(f"{name} must be 1-D, got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise StatsInputError(f"{name} holds a non-finite value (unscored entries must be dropped)")
    return arr


def bootstrap_mean_ci(
    values: Sequence[float] | np.ndarray,
    n_boot: int = 2000,
    *,
    seed: int,
    alpha: float = 0.05,
) -> BootstrapCI:
    """Percentile-bootstrap interval for the mean of ``values`` (resampling observations).

    Deterministic for a given ``seed``. With few observations the percentile interval
    under-covers; report n alongside it.
    """
    arr = _as_finite_array(values, "values")
    _check_bootstrap(arr.size, n_boot, alpha)
    return _percentile_ci(arr, n_boot, seed, alpha)


def _paired(a: PerTask, b: PerTask) -> np.ndarray:
    """Per-task differences a - b; mappings are matched by task id and must share every key."""
    if isinstance(a, Mapping) != isinstance(b, Mapping):
        raise StatsInputError("pass both arguments as task->value mappings, or both as sequences")
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if set(a) != set(b):
            missing = sorted(set(a) ^ set(b))
            raise StatsInputError(f"a and b must cover the same tasks; unmatched: {missing[:5]}")
        keys = sorted(a)
        a_arr = _as_finite_array([a[key] for key in keys], "a_by_task")
        b_arr = _as_finite_array([b[key] for key in keys], "b_by_task")
    else:
        a_arr = _as_finite_array(cast("Sequence[float] | np.ndarray", a), "a_by_task")
        b_arr = _as_finite_array(cast("Sequence[float] | np.ndarray", b), "b_by_task")
        if a_arr.size != b_arr.size:
            raise StatsInputError(f"a and b differ in length: {a_arr.size} vs {b_arr.size}")
    return a_arr - b_arr


def paired_bootstrap_ci(
    a_by_task: PerTask,
    b_by_task: PerTask,
    n_boot: int = 2000,
    *,
    seed: int,
    alpha: float = 0.05,
) -> BootstrapCI:
    """Paired percentile-bootstrap interval for mean(a - b), resampling tasks.

    ``a_by_task`` and ``b_by_task`` are per-task scores of two arms (e.g. two checkpoints'
    success rates), either mappings keyed by task id (matched by key) or equal-length sequences
    aligned by position. Resampling whole tasks keeps the pairing, so task difficulty cancels.
    Returns the point estimate mean(a - b) and the (alpha/2, 1 - alpha/2) percentiles.
    """
    diff = _paired(a_by_task, b_by_task)
    _check_bootstrap(diff.size, n_boot, alpha)
    return _percentile_ci(diff, n_boot, seed, alpha)


def uniform_outcome(*by_task: Mapping[str, float]) -> str | None:
    """``"failed"`` when every task of every mapping scored 0, ``"succeeded"`` when every one
    scored 1, else ``None``. A paired difference between evaluations with a uniform outcome is
    0 with a zero-width interval whatever the policies: no evidence that they agree, and no
    room for a regression (all 0) or a gain (all 1) to show, so it is not a measurement."""
    rates = [float(r) for m in by_task for r in m.values()]
    if not rates:
        return None
    if max(rates) == 0.0:
        return "failed"
    if min(rates) == 1.0:
        return "succeeded"
    return None


class SharedTaskComparison(NamedTuple):
    """A paired comparison of two evaluations over the tasks both scored: how many they share,
    ``no_signal`` (``uniform_outcome`` of the shared tasks: ``"failed"``/``"succeeded"``, else
    ``None``) and the paired interval of ``a - b`` (``None`` below 2 shared tasks or without
    signal: nothing was measured)."""

    tasks: int
    no_signal: str | None
    ci: BootstrapCI | None


def shared_task_comparison(a: Mapping[str, float], b: Mapping[str, float], *, seed: int,
                           n_boot: int = 2000) -> SharedTaskComparison:
    """``paired_bootstrap_ci`` of per-task ``a - b`` over the task ids in both mappings, when it
    measures something (``SharedTaskComparison``)."""
    common = sorted(set(a) & set(b))
    ca, cb = {t: a[t] for t in common}, {t: b[t] for t in common}
    if len(common) < 2:
        return SharedTaskComparison(len(common), None, None)
    outcome = uniform_outcome(ca, cb)
    if outcome is not None:
        return SharedTaskComparison(len(common), outcome, None)
    return SharedTaskComparison(len(common), None,
                                paired_bootstrap_ci(ca, cb, n_boot, seed=seed))
