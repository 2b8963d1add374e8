"""Loss reducers: hand-worked values, per-token weights, empty rows, validation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from closedloop.learn import (
    REDUCERS,
    MaskError,
    UnknownNameError,
    apply_group_reward_scale,
    reduce_loss,
    reducer_weights,
)

NAN = float("nan")

# Row 0: 3 action tokens in 2 turns (turn 0: ℓ=1,2; turn 1: ℓ=3), one padding slot.
# Row 1: 1 action token (ℓ=4). Row 2: no action tokens (counted in B, contributes 0).
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
TURNS = torch.tensor([[0, 0, 1, -1], [0, -1, -1, -1], [-1, -1, -1, -1]])
LOSS = torch.tensor([[1.0, 2.0, 3.0, NAN], [4.0, NAN, NAN, NAN], [NAN, NAN, NAN, NAN]])

HAND = {
    # (1/B) Σ_i Σ_t ℓ = (6 + 4 + 0) / 3
    "episode_sum": 10 / 3,
    # (1/B) Σ_i (1/T_i) Σ_t ℓ = (6/3 + 4/1 + 0) / 3
    "length_normalized": 2.0,
    # Σ ℓ / Σ T_i = 10 / 4
    "token_mean": 2.5,
    # (1/B) Σ_i (1/K_i) Σ_k mean_k = ((1/2)(1.5 + 3) + 4 + 0) / 3 = 6.25 / 3
    "turn_mass_conserving": 6.25 / 3,
    # Σ_turns mean_k / Σ K_i = (1.5 + 3 + 4) / 3
    "turn_mean": 8.5 / 3,
}


def test_hand_table_covers_every_reducer() -> None:
    assert set(HAND) == set(REDUCERS)


@pytest.mark.parametrize("name", sorted(HAND))
def test_hand_worked_values(name: str) -> None:
    out = reduce_loss(LOSS, MASK, TURNS, reducer=name)
    assert float(out.loss) == pytest.approx(HAND[name], rel=1e-6)
    assert out.n_action_tokens == 4 and out.n_empty_rows == 1
    assert float(out.weights_B_T[MASK == 0].abs().sum()) == 0.0


@pytest.mark.parametrize("name", sorted(HAND))
def test_padding_gets_zero_gradient(name: str) -> None:
    loss = LOSS.clone().requires_grad_(True)
    reduce_loss(loss, MASK, TURNS, reducer=name).loss.backward()
    assert loss.grad is not None and bool(torch.isfinite(loss.grad).all())
    assert float(loss.grad[MASK == 0].abs().sum()) == 0.0


def test_per_token_weights() -> None:
    b = 3
    w = {name: reducer_weights(name, MASK, TURNS) for name in REDUCERS}
    torch.testing.assert_close(w["episode_sum"][0], torch.tensor([1, 1, 1, 0]) / b)
    torch.testing.assert_close(w["length_normalized"][0], torch.tensor([1, 1, 1, 0]) / (b * 3))
    torch.testing.assert_close(w["token_mean"][0], torch.tensor([1, 1, 1, 0]) / 4)
    # turn 0 has 2 tokens, turn 1 has 1; K_0 = 2
    torch.testing.assert_close(
        w["turn_mass_conserving"][0], torch.tensor([1 / 4, 1 / 4, 1 / 2, 0]) / b
    )
    torch.testing.assert_close(w["turn_mean"][0], torch.tensor([1 / 2, 1 / 2, 1, 0]) / 3)


def test_all_empty_batch_is_zero_not_nan() -> None:
    mask = torch.zeros(2, 3)
    for name in REDUCERS:
        out = reduce_loss(torch.full((2, 3), NAN), mask, torch.full((2, 3), -1), reducer=name)
        assert float(out.loss) == 0.0 and out.n_empty_rows == 2


@given(
    lengths=st.lists(st.integers(min_value=0, max_value=6), min_size=1, max_size=5),
    seed=st.integers(min_value=0, max_value=2**16),
)
@settings(max_examples=40, deadline=None)
def test_single_turn_episodes_make_turn_mass_equal_length_normalized(
    lengths: list[int], seed: int
) -> None:
    t = 6
    mask = torch.tensor([[1] * n + [0] * (t - n) for n in lengths])
    turns = torch.where(mask > 0, 0, -1)
    loss = torch.randn(len(lengths), t, generator=torch.Generator().manual_seed(seed))
    a = reduce_loss(loss, mask, turns, reducer="turn_mass_conserving").loss
    b = reduce_loss(loss, mask, turns, reducer="length_normalized").loss
    torch.testing.assert_close(a, b)


@given(st.lists(st.integers(min_value=0, max_value=8), min_size=1, max_size=6))
@settings(max_examples=40, deadline=None)
def test_total_mass_of_each_reducer(lengths: list[int]) -> None:
    t = 8
    mask = torch.tensor([[1] * n + [0] * (t - n) for n in lengths])
    turns = torch.where(mask > 0, torch.arange(t) // 3, -1)  # turns of 3 tokens
    nonempty = sum(n > 0 for n in lengths)
    b = len(lengths)
    w = {name: float(reducer_weights(name, mask, turns, torch.float64).sum()) for name in REDUCERS}
    assert w["episode_sum"] == pytest.approx(sum(lengths) / b)
    assert w["length_normalized"] == pytest.approx(nonempty / b)
    assert w["turn_mass_conserving"] == pytest.approx(nonempty / b)
    assert w["token_mean"] == pytest.approx(1.0 if nonempty else 0.0)
    assert w["turn_mean"] == pytest.approx(1.0 if nonempty else 0.0)


def test_unknown_reducer_is_named() -> None:
    with pytest.raises(UnknownNameError, match="'mean'"):
        reduce_loss(LOSS, MASK, TURNS, reducer="mean")


def test_validation_errors() -> None:
    with pytest.raises(MaskError, match="turn_ids"):
        reduce_loss(LOSS, MASK, None, reducer="turn_mass_conserving")
    with pytest.raises(MaskError, match="negative"):
        reduce_loss(LOSS, MASK, torch.full_like(TURNS, -1), reducer="turn_mean")
    with pytest.raises(MaskError, match="0 and 1"):
        reduce_loss(LOSS, MASK * 2, TURNS, reducer="episode_sum")
    with pytest.raises(MaskError, match="shape"):
        reduce_loss(LOSS[:, :3], MASK, TURNS, reducer="episode_sum")
    with pytest.raises(MaskError, match="integer"):
        reduce_loss(LOSS, MASK, TURNS.float(), reducer="turn_mean")


def test_group_reward_scale() -> None:
    adv = torch.tensor([0.5, -0.5])
    rewards = torch.tensor([1.0, 0.0])
    assert apply_group_reward_scale(adv, rewards, "none") is adv
    # population std of [1, 0] is .5
    torch.testing.assert_close(
        apply_group_reward_scale(adv, rewards, "std", eps=0.0), torch.tensor([1.0, -1.0])
    )
    with pytest.raises(UnknownNameError):
        apply_group_reward_scale(adv, rewards, "mad")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(REDUCERS))
def test_sub_batch_weights_are_proportional_to_full_batch_rows(name: str) -> None:
    # The factorization w = c(batch) · u(row) that micro-batch rescaling relies on.
    full = reducer_weights(name, MASK, TURNS, torch.float64)
    for rows in ([0], [0, 1], [1, 2], [0, 2]):
        local = reducer_weights(name, MASK[rows], TURNS[rows], torch.float64)
        scale = float(full[rows].sum()) / float(local.sum())
        torch.testing.assert_close(local * scale, full[rows])
