"""Credit estimators: golden values from the seeds, hand-worked RLOO, censoring rules."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from closedloop.learn import (
    ESTIMATORS,
    GroupTooSmallError,
    NonFiniteRewardError,
    UnknownNameError,
    apply_group_reward_scale,
    dr_grpo,
    get_estimator,
    group_advantages,
    grpo,
    p_informative,
    p_zero_variance,
    returns_to_go,
    rloo,
    summarize_credit,
)

rewards_lists = st.lists(
    st.floats(min_value=-10, max_value=10, allow_nan=False), min_size=2, max_size=16
)


def test_grpo_golden() -> None:
    # mean .5, population std sqrt(.125) = .353553; .5 / .353553 = 1.41421 (seed 000 §5)
    got = grpo([1.0, 0.5, 0.5, 0.0], eps=1e-6)
    torch.testing.assert_close(got, torch.tensor([1.41421, 0.0, 0.0, -1.41421]), atol=1e-4, rtol=0)


def test_returns_to_go_golden() -> None:
    # G2 = .5; G1 = 0 + .8 * .5 = .4; G0 = .2 + .8 * .4 = .52 (seed 002 §11.3.2)
    got = returns_to_go([0.2, 0.0, 0.5], 0.8)
    torch.testing.assert_close(got, torch.tensor([0.52, 0.4, 0.5]))


def test_returns_to_go_edges() -> None:
    assert returns_to_go([], 0.9).numel() == 0
    torch.testing.assert_close(returns_to_go([1.0, 1.0, 1.0], 1.0), torch.tensor([3.0, 2.0, 1.0]))
    with pytest.raises(ValueError):
        returns_to_go([1.0], 1.5)


def test_p_informative_golden() -> None:
    # 1 - .01^8 - .99^8 = 1 - 1e-16 - .922745 = .077255; 1/.077255 = 12.94 (seed 002 §11.4.1)
    assert p_informative(0.01, 8) == pytest.approx(0.0773, abs=5e-5)
    assert 1.0 / p_informative(0.01, 8) == pytest.approx(12.94, abs=0.01)
    assert p_zero_variance(0.5, 2) == pytest.approx(0.5)
    assert p_informative(0.0, 8) == 0.0 and p_informative(1.0, 8) == 0.0


def test_rloo_hand_worked() -> None:
    # [1,0,0,1]: A_0 = 1 - (0+0+1)/3 = 2/3; A_1 = 0 - (1+0+1)/3 = -2/3
    torch.testing.assert_close(
        rloo([1.0, 0.0, 0.0, 1.0]), torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    )
    # [3,1,2]: 3 - 1.5 = 1.5; 1 - 2.5 = -1.5; 2 - 2 = 0
    torch.testing.assert_close(rloo([3.0, 1.0, 2.0]), torch.tensor([1.5, -1.5, 0.0]))
    # G=2: each member's baseline is the other: [5, 2] -> [3, -3]
    torch.testing.assert_close(rloo(torch.tensor([5.0, 2.0])), torch.tensor([3.0, -3.0]))


def test_dr_grpo_hand_worked() -> None:
    torch.testing.assert_close(dr_grpo([3.0, 1.0, 2.0]), torch.tensor([1.0, -1.0, 0.0]))


@given(rewards_lists)
@settings(max_examples=50, deadline=None)
def test_rloo_is_scaled_centering(rewards: list[float]) -> None:
    r = torch.tensor(rewards, dtype=torch.float64)
    g = len(rewards)
    a = rloo(r)
    assert abs(float(a.sum())) < 1e-9 * max(1.0, float(r.abs().max()) * g)
    torch.testing.assert_close(a, g / (g - 1) * dr_grpo(r))


@given(rewards_lists)
@settings(max_examples=50, deadline=None)
def test_grpo_is_dr_grpo_scaled_by_std(rewards: list[float]) -> None:
    r = torch.tensor(rewards, dtype=torch.float64)
    torch.testing.assert_close(grpo(r), apply_group_reward_scale(dr_grpo(r), r, "std"))


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_estimators_reject_singleton_groups(name: str) -> None:
    with pytest.raises(GroupTooSmallError):
        get_estimator(name)([1.0])


def test_estimators_reject_non_finite() -> None:
    with pytest.raises(NonFiniteRewardError):
        rloo([1.0, float("nan")])


def test_unknown_estimator_is_named() -> None:
    with pytest.raises(UnknownNameError, match=r"'ppo'.*dr_grpo, grpo, rloo"):
        get_estimator("ppo")
    with pytest.raises(UnknownNameError):
        group_advantages([1.0, 0.0], estimator="reinforce")
    with pytest.raises(UnknownNameError):
        group_advantages([1.0, 0.0], censor_rule="fill_zero")  # type: ignore[arg-type]


def test_discard_group_rule() -> None:
    got = group_advantages([1.0, None, 0.0, 1.0], "rloo", [False, True, False, False])
    assert got.discarded and got.advantages is None
    assert got.discard_reason == "censored_member"
    assert got.n_censored == 1 and got.member_indices == ()


def test_drop_censored_never_scores_zero() -> None:
    rewards = [1.0, None, 0.0, 1.0]
    censored = [False, True, False, False]
    got = group_advantages(rewards, "rloo", censored, "drop_censored")
    assert not got.discarded and got.member_indices == (0, 2, 3)
    assert got.advantages is not None
    # RLOO over [1, 0, 1] only: [1 - .5, 0 - 1, 1 - .5]
    torch.testing.assert_close(got.advantages, torch.tensor([0.5, -1.0, 0.5]))
    # Scoring the censored member 0 would give a different baseline (the bug this rule prevents).
    as_zero = rloo([1.0, 0.0, 0.0, 1.0])[[0, 2, 3]]
    assert not torch.allclose(got.advantages, as_zero)


def test_drop_censored_needs_two_members() -> None:
    got = group_advantages([1.0, float("nan"), 0.0], "grpo", [False, True, True], "drop_censored")
    assert got.discarded and got.discard_reason == "too_few_uncensored"


def test_uncensored_none_is_an_error() -> None:
    with pytest.raises(NonFiniteRewardError):
        group_advantages([1.0, None, 0.0], "rloo")


def test_zero_variance_flag_and_summary() -> None:
    groups = [
        group_advantages([1.0, 1.0, 1.0], "grpo"),  # all success: zero variance, kept
        group_advantages([0.0, 0.0], "rloo"),  # all failure: zero variance, kept
        group_advantages([1.0, 0.0, 0.0], "rloo"),  # informative
        group_advantages([1.0, 0.0], "rloo", [True, False]),  # discarded (censored member)
        group_advantages([1.0, 0.0, 1.0], "rloo", [True, True, False], "drop_censored"),
    ]
    assert groups[0].zero_variance and groups[0].advantages is not None
    assert float(groups[0].advantages.abs().sum()) == 0.0
    summary = summarize_credit(groups)
    assert (summary.n_groups, summary.n_scored_groups) == (5, 3)
    assert summary.n_zero_variance == 2 and summary.n_discarded == 2
    assert dict(summary.discard_reasons) == {"censored_member": 1, "too_few_uncensored": 1}
    assert summary.zero_variance_rate == pytest.approx(2 / 3)
    assert summary.discard_rate == pytest.approx(2 / 5)
    assert (summary.n_members, summary.n_members_scored, summary.n_members_censored) == (13, 8, 3)


def test_empty_summary_rates_are_none() -> None:
    summary = summarize_credit([])
    assert summary.zero_variance_rate is None and summary.discard_rate is None


def test_group_advantages_matches_estimator_on_tensor_input() -> None:
    r = torch.tensor([0.3, 0.9, 0.1, 0.5], dtype=torch.float64)
    got = group_advantages(r, "grpo")
    assert got.advantages is not None and got.advantages.dtype == torch.float64
    torch.testing.assert_close(got.advantages, grpo(r))
    assert not math.isnan(float(got.advantages.sum()))
