"""Evaluation statistics: hand-worked pass@k / pass^k, Wilson values, bootstrap coverage."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from closedloop.evaluate import (
    EmptySampleError,
    StatsInputError,
    bootstrap_mean_ci,
    paired_bootstrap_ci,
    pass_at_k,
    pass_hat_k,
    wilson_interval,
)


def test_pass_at_k_and_pass_hat_k_hand_worked() -> None:
    # n=3, c=1, k=3: all three attempts are used, one succeeded -> pass@3 = 1, pass^3 = 0
    assert pass_at_k(3, 1, 3) == 1.0
    assert pass_hat_k(3, 1, 3) == 0.0
    # n=5, c=2, k=2: pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10; pass^2 = C(2,2)/C(5,2) = 1/10
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_hat_k(5, 2, 2) == pytest.approx(0.1)
    # k=1 both reduce to c/n
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3) and pass_hat_k(10, 3, 1) == pytest.approx(0.3)


@given(
    st.integers(min_value=1, max_value=40).flatmap(
        lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))
    )
)
@settings(max_examples=200, deadline=None)
def test_pass_hat_k_le_pass_at_1_le_pass_at_k(args: tuple[int, int, int]) -> None:
    n, c, k = args
    hat, at = pass_hat_k(n, c, k), pass_at_k(n, c, k)
    assert 0.0 <= hat <= c / n + 1e-12 <= at + 2e-12 <= 1.0 + 2e-12


def test_pass_at_k_matches_brute_force_over_subsets() -> None:
    # Unbiasedness by definition: average over all k-subsets of the n attempts.
    from itertools import combinations

    outcomes = [1, 0, 0, 1, 0, 1, 0]
    n, c, k = len(outcomes), sum(outcomes), 3
    subsets = list(combinations(outcomes, k))
    assert pass_at_k(n, c, k) == pytest.approx(np.mean([max(s) for s in subsets]))
    assert pass_hat_k(n, c, k) == pytest.approx(np.mean([min(s) for s in subsets]))


def test_pass_k_validation() -> None:
    with pytest.raises(EmptySampleError):
        pass_at_k(0, 0, 1)
    with pytest.raises(StatsInputError):
        pass_at_k(3, 4, 1)
    with pytest.raises(StatsInputError):
        pass_hat_k(3, 1, 4)


def test_wilson_known_values() -> None:
    # 0/10: center = half = (z²/2n)/(1+z²/n) = .19208/1.38416 = .13877 -> (0, .2775)
    lo, hi = wilson_interval(0, 10)
    assert lo == pytest.approx(0.0, abs=1e-12) and hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = wilson_interval(5, 10)
    assert (lo, hi) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    lo, hi = wilson_interval(10, 10)
    assert (lo, hi) == pytest.approx((0.7225, 1.0), abs=1e-4)


def test_wilson_validation() -> None:
    with pytest.raises(EmptySampleError):
        wilson_interval(0, 0)
    with pytest.raises(StatsInputError):
        wilson_interval(11, 10)


@given(
    st.integers(min_value=1, max_value=500).flatmap(
        lambda n: st.tuples(st.integers(0, n), st.just(n))
    )
)
@settings(max_examples=200, deadline=None)
def test_wilson_contains_the_point_estimate(args: tuple[int, int]) -> None:
    s, n = args
    lo, hi = wilson_interval(s, n)
    assert 0.0 <= lo <= s / n <= hi <= 1.0


def test_bootstrap_is_deterministic_and_contains_the_mean() -> None:
    values = [0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    a = bootstrap_mean_ci(values, n_boot=500, seed=3)
    b = bootstrap_mean_ci(values, n_boot=500, seed=3)
    assert a == b
    assert a.estimate == pytest.approx(0.625) and a.lo <= a.estimate <= a.hi
    assert a.n == 8 and a.n_boot == 500 and a.alpha == 0.05


def test_bootstrap_validation() -> None:
    with pytest.raises(EmptySampleError):
        bootstrap_mean_ci([], seed=0)
    with pytest.raises(StatsInputError, match="non-finite"):
        bootstrap_mean_ci([1.0, math.nan], seed=0)
    with pytest.raises(StatsInputError, match="same tasks"):
        paired_bootstrap_ci({"t1": 1.0}, {"t2": 1.0}, seed=0)
    with pytest.raises(StatsInputError, match="length"):
        paired_bootstrap_ci([1.0, 2.0], [1.0], seed=0)
    with pytest.raises(StatsInputError, match="both"):
        paired_bootstrap_ci({"t1": 1.0}, [1.0], seed=0)


def test_paired_bootstrap_matches_by_task_id() -> None:
    a = {"t1": 0.9, "t2": 0.5, "t3": 0.1}
    b = {"t3": 0.0, "t1": 0.7, "t2": 0.5}  # different order: pairing is by key
    ci = paired_bootstrap_ci(a, b, n_boot=200, seed=0)
    assert ci.estimate == pytest.approx((0.2 + 0.0 + 0.1) / 3)
    assert ci.n == 3


def test_bootstrap_mean_ci_coverage() -> None:
    # 200 repetitions of n=30 draws with known mean; a 95% percentile interval should cover the
    # mean in roughly 95% of them. With 200 reps the binomial SD of the coverage is ~1.5%, and the
    # percentile bootstrap under-covers slightly at n=30, so [0.88, 0.99] is a fair band.
    rng = np.random.default_rng(2024)
    true_mean = 1.0
    covered = 0
    for rep in range(200):
        sample = rng.normal(true_mean, 2.0, size=30)
        ci = bootstrap_mean_ci(sample, n_boot=1000, seed=rep)
        covered += ci.lo <= true_mean <= ci.hi
    assert 0.88 <= covered / 200 <= 0.99


def test_paired_bootstrap_ci_coverage() -> None:
    # Tasks differ a lot in difficulty; arm a adds a known effect of 0.1. Pairing by task removes
    # the difficulty spread, so the interval is narrow and should still cover 0.1 ~95% of the time.
    rng = np.random.default_rng(7)
    effect, covered, widths = 0.1, 0, []
    for rep in range(200):
        difficulty = rng.uniform(0.0, 1.0, size=40)
        a = difficulty + effect + rng.normal(0.0, 0.1, size=40)
        b = difficulty + rng.normal(0.0, 0.1, size=40)
        ci = paired_bootstrap_ci(a, b, n_boot=1000, seed=rep)
        covered += ci.lo <= effect <= ci.hi
        widths.append(ci.hi - ci.lo)
    assert 0.88 <= covered / 200 <= 0.99
    assert float(np.mean(widths)) < 0.1  # unpaired would be ~0.26 wide (difficulty SD .29)


@given(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0]), min_size=1, max_size=12),
       st.integers(min_value=1, max_value=11))
def test_uniform_outcome_is_all_failed_or_all_succeeded(rates: list[float], cut: int) -> None:
    from closedloop.evaluate.stats import uniform_outcome

    a = {f"t{i}": r for i, r in enumerate(rates[:cut])}
    b = {f"t{i}": r for i, r in enumerate(rates[cut:])}
    expected = ("failed" if max(rates) == 0.0 else "succeeded" if min(rates) == 1.0
                else None)
    assert uniform_outcome(a, b) == expected
    assert uniform_outcome() is None and uniform_outcome({}, {}) is None


def test_a_paired_difference_of_uniform_outcomes_is_not_measured() -> None:
    from closedloop.evaluate.heldout import paired_difference

    class Scores:
        def __init__(self, rates: dict[str, float]) -> None:
            self.rates = rates

        def per_task_success(self) -> dict[str, float]:
            return dict(self.rates)

    zeros, ones = Scores({"a": 0.0, "b": 0.0}), Scores({"a": 1.0, "b": 1.0})
    none = paired_difference(zeros, zeros, 0, "x")  # type: ignore[arg-type]
    assert none["measured"] is False and none["no_signal"] == "failed" and "estimate" not in none
    all_won = paired_difference(ones, ones, 0, "x")  # type: ignore[arg-type]
    assert all_won["measured"] is False and all_won["no_signal"] == "succeeded"
    gained = paired_difference(ones, zeros, 0, "x")  # type: ignore[arg-type]
    assert gained["measured"] and gained["estimate"] == 1.0


@given(st.dictionaries(st.sampled_from("abcdefg"), st.sampled_from([0.0, 0.5, 1.0])),
       st.dictionaries(st.sampled_from("defghij"), st.sampled_from([0.0, 0.5, 1.0])))
@settings(max_examples=60)
def test_a_shared_task_comparison_pairs_the_shared_tasks_only(
        a: dict[str, float], b: dict[str, float]) -> None:
    """Both the experiment summary (``controls.paired_diff``) and the report
    (``heldout.paired_difference``) measure through it: the interval is the paired bootstrap
    over the shared task ids, and nothing is measured below 2 of them or without signal."""
    from closedloop.evaluate.stats import shared_task_comparison, uniform_outcome
    from closedloop.experiments.controls import paired_diff

    shared = sorted(set(a) & set(b))
    pair = shared_task_comparison(a, b, seed=3, n_boot=200)
    assert pair.tasks == len(shared)
    ca, cb = {t: a[t] for t in shared}, {t: b[t] for t in shared}
    if len(shared) < 2 or uniform_outcome(ca, cb):
        assert pair.ci is None and paired_diff(a, b, 3) is None
        assert pair.no_signal == (uniform_outcome(ca, cb) if len(shared) >= 2 else None)
        return
    assert pair.no_signal is None
    assert pair.ci == paired_bootstrap_ci(ca, cb, 200, seed=3)
    diff = paired_diff(a, b, 3)
    assert diff is not None and diff["n_tasks"] == len(shared)
    assert diff["estimate"] == pytest.approx(np.mean([ca[t] - cb[t] for t in shared]))
