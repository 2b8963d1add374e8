"""The reward nulls (closedloop.learn.null_control, docs/null-control.md) on a toy policy: a
softmax over a tiny vocabulary, episodes of fixed tokens of different lengths. Expectations are
exact: every permutation of a group's rewards (and both signs of the flip) enumerated, each
update computed by the project's own credit, reducers and objectives in float64 (the credit's
advantages are float32, hence "zero" is below 1e-7 against a real-reward gradient above 1e-2)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import pytest
import torch

from closedloop.contracts.batch import KLSpec
from closedloop.contracts.update import ObjectiveInputs
from closedloop.errors import UnknownNameError
from closedloop.learn.credit import group_advantages
from closedloop.learn.null_control import control_rewards, relabel
from closedloop.learn.objectives import get_objective
from closedloop.learn.reducers import apply_group_reward_scale

F64 = torch.float64
V = 5
# a group of five episodes: token ids (lengths 1..5, so a length-biased update shows) and
# rewards (one success among failures: a skewed group), the fourth member censored (None)
TOKENS = ([0], [1, 2], [3, 0, 1], [4, 4, 2, 1], [2, 3, 1, 0, 4])
REWARDS: tuple[float | None, ...] = (1.0, 0.0, 0.0, None, 0.0)


def _batch(theta: torch.Tensor, members: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor,
                                                                   torch.Tensor]:
    """log π(a_t) (context-free softmax policy) of the members' tokens, padded, with the mask
    and turn ids."""
    logp = torch.log_softmax(theta, dim=0)
    T = max(len(TOKENS[i]) for i in members)
    new = torch.zeros(len(members), T, dtype=F64)
    mask = torch.zeros(len(members), T, dtype=torch.bool)
    for row, i in enumerate(members):
        n = len(TOKENS[i])
        new[row, :n] = logp[torch.tensor(TOKENS[i])]
        mask[row, :n] = True
    return new, mask, torch.zeros(len(members), T, dtype=torch.long)


def gradient(theta0: torch.Tensor, rewards: Sequence[float | None], *, objective: str,
             reducer: str, estimator: str = "rloo", scale: str = "none", beta: float = 0.0,
             behavior_shift: float = 0.0, ref_theta: torch.Tensor | None = None
             ) -> torch.Tensor:
    """∇θ of the objective's loss on the group, the censored member dropped (drop_censored)."""
    censored = [r is None for r in rewards]
    credit = group_advantages(list(rewards), estimator, censored, "drop_censored")
    assert credit.advantages is not None
    adv = credit.advantages.to(F64)
    if scale == "std":
        adv = apply_group_reward_scale(adv, torch.tensor(
            [rewards[i] for i in credit.member_indices], dtype=F64), "std").to(F64)
    theta = theta0.clone().requires_grad_(True)
    new, mask, turns = _batch(theta, credit.member_indices)
    beh = new.detach() + behavior_shift * torch.linspace(-1, 1, new.shape[1], dtype=F64)
    ref = None
    if ref_theta is not None:
        ref = _batch(ref_theta, credit.member_indices)[0]
    out = get_objective(objective)(ObjectiveInputs(
        new_logprobs_B_T=new, behavior_logprobs_B_T=torch.where(mask, beh, 0.0),
        advantages_B=adv, mask_B_T=mask, turn_ids_B_T=turns, reducer=reducer,
        ref_logprobs_B_T=ref,
        kl_spec=KLSpec(estimator="k3", beta=beta, placement="loss", sampling="behavior")
        if beta > 0 else None))
    (grad,) = torch.autograd.grad(out.loss, [theta])
    return grad


def nulls(rewards: Sequence[float | None], flip: bool) -> list[list[float | None]]:
    """Every relabelling the null can draw, each equally likely."""
    n = sum(r is not None for r in rewards)
    return [relabel(rewards, perm, f) for perm in itertools.permutations(range(n))
            for f in ((False, True) if flip else (False,))]


def expected(fn: Callable[[Sequence[float | None]], torch.Tensor],
             rewards: Sequence[float | None], flip: bool) -> torch.Tensor:
    grads = [fn(r) for r in nulls(rewards, flip)]
    return torch.stack(grads).mean(dim=0)


THETA = torch.tensor([0.3, -0.2, 0.9, 0.0, -0.7], dtype=F64)


@pytest.mark.parametrize("flip", [False, True])
@pytest.mark.parametrize("reducer", ["episode_sum", "token_mean", "length_normalized",
                                     "turn_mass_conserving"])
@pytest.mark.parametrize(("estimator", "scale"), [("rloo", "none"), ("grpo", "none"),
                                                  ("dr_grpo", "none"), ("rloo", "std")])
def test_the_null_has_zero_expected_gradient_for_every_reducer_and_estimator(
        flip: bool, reducer: str, estimator: str, scale: str) -> None:
    def g(rewards: Sequence[float | None]) -> torch.Tensor:
        return gradient(THETA, rewards, objective="reinforce_with_kl", reducer=reducer,
                        estimator=estimator, scale=scale)

    real = g(REWARDS)
    assert float(real.abs().max()) > 1e-2  # the real reward pushes
    assert float(expected(g, REWARDS, flip).abs().max()) < 1e-7


def test_with_kl_the_null_expects_the_kl_gradient_alone_which_is_zero_at_the_reference() -> None:
    ref = THETA + torch.tensor([0.2, 0.0, -0.1, 0.3, 0.0], dtype=F64)

    def g(rewards: Sequence[float | None], at: torch.Tensor = THETA) -> torch.Tensor:
        return gradient(at, rewards, objective="reinforce_with_kl", reducer="episode_sum",
                        beta=0.5, ref_theta=ref)

    kl_only = gradient(THETA, (0.0, 0.0, 0.0, None, 0.0), objective="reinforce_with_kl",
                       reducer="episode_sum", beta=0.5, ref_theta=ref)  # all-zero advantages
    assert float(kl_only.abs().max()) > 1e-3  # a restoring pull toward π_ref, not the reward
    torch.testing.assert_close(expected(g, REWARDS, True), kl_only, rtol=0, atol=1e-7)
    at_ref = expected(lambda r: g(r, ref), REWARDS, True)
    assert float(at_ref.abs().max()) < 1e-7


def test_a_clip_with_ratios_away_from_1_pushes_under_either_null() -> None:
    """ρ ≠ 1 (a reused batch's later pass, or a generator/trainer mismatch): PPO's clip binds
    on one advantage sign only, so neither null is zero-push there (the documented limit)."""
    def g(rewards: Sequence[float | None], shift: float) -> torch.Tensor:
        return gradient(THETA, rewards, objective="ppo_clip", reducer="episode_sum",
                        behavior_shift=shift)

    at_one = expected(lambda r: g(r, 0.0), REWARDS, True)
    assert float(at_one.abs().max()) < 1e-7  # ρ = 1: the clip never binds
    for flip in (False, True):
        assert float(expected(lambda r: g(r, 0.6), REWARDS, flip).abs().max()) > 1e-3


def test_the_flip_makes_sign_like_steps_zero_mean_where_the_shuffle_alone_does_not() -> None:
    """Adam's first step is lr · sign(g) per parameter: odd in g. The shuffle of a skewed group
    (one success) biases sign(g); the flip makes the advantages' distribution symmetric, so
    E[sign(g)] = 0 exactly."""
    def sign(rewards: Sequence[float | None]) -> torch.Tensor:
        return torch.sign(gradient(THETA, rewards, objective="reinforce_with_kl",
                                   reducer="episode_sum"))

    assert float(expected(sign, REWARDS, False).abs().max()) > 0.1
    assert float(expected(sign, REWARDS, True).abs().max()) < 1e-7


def test_relabelling_keeps_the_censored_and_the_zero_variance_groups() -> None:
    assert relabel([1.0, None, 0.0], [1, 0], False) == [0.0, None, 1.0]
    assert relabel([1.0, None, 0.0, 0.0], [0, 1, 2], True) == pytest.approx(
        [-1 / 3, None, 2 / 3, 2 / 3])  # reflected about the mean 1/3: advantages negated
    assert relabel([1.0, 1.0], [1, 0], True) == [1.0, 1.0]  # zero variance stays so
    with pytest.raises(ValueError, match="not a permutation"):
        relabel([1.0, 0.0], [0, 0], False)


@pytest.mark.parametrize("control", ["shuffle_within_group", "shuffle_flip_within_group"])
def test_the_seeded_null_is_not_the_identity_and_reproduces(control: str) -> None:
    rewards: list[float | None] = [1.0, 0.0, 0.0, None, 0.0]
    draws = [control_rewards(rewards, control, f"s{i:04d}-g0") for i in range(200)]
    assert draws[7] == control_rewards(rewards, control, "s0007-g0")  # resumes identically
    assert all(d[3] is None for d in draws)
    moved = sum(d != rewards for d in draws) / len(draws)
    assert 0.7 < moved < 0.95 if control == "shuffle_within_group" else moved > 0.85
    where = [next(i for i, r in enumerate(d) if r == max(x for x in d if x is not None))
             for d in draws]
    assert set(where) == {0, 1, 2, 4}  # the success lands on every scored member
    assert control_rewards(rewards, "none", "g") == rewards
    with pytest.raises(UnknownNameError):
        control_rewards(rewards, "shuffle_everything", "g")


def test_the_shuffle_is_the_one_resumed_runs_recorded() -> None:
    """The permutation is the one ``random.Random(f"shuffle/{group_id}").shuffle`` drew
    before the null moved to closedloop.learn.null_control: an interrupted run resumes alike."""
    rewards = [1.0, 0.0, 0.5, 0.0, 0.25]
    for gid in ("s0000-g0", "s0003-g1", "s0011-g2"):
        values = list(rewards)
        random.Random(f"shuffle/{gid}").shuffle(values)
        assert control_rewards(rewards, "shuffle_within_group", gid) == values


def test_the_training_run_trains_on_the_configured_null() -> None:
    """The RL step credits the relabelled rewards (``assign_credit``) and counts the members
    it relabelled: the RL arm none, the null every member of a mixed group it moved."""
    from closedloop.config import CreditSection
    from closedloop.training.rl_step import assign_credit, relabelled_members
    from tests.factories import make_traj

    rewards = [1.0, 0.0, 0.0, 0.0]
    episodes = tuple(SimpleNamespace(trajectory=make_traj(
        episode_id=f"e{i}", reward={"task_success": r})) for i, r in enumerate(rewards))
    group = SimpleNamespace(lease=SimpleNamespace(group_id="s0001-g0"), episodes=episodes)
    for control in ("none", "shuffle_within_group", "shuffle_flip_within_group"):
        credit = CreditSection(reward_control=control)  # type: ignore[arg-type]
        batch = assign_credit([group], credit)  # type: ignore[list-item]
        want = control_rewards(rewards, control, "s0001-g0")
        expected_adv = group_advantages(want, "rloo", [False] * 4).advantages
        assert expected_adv is not None
        assert list(batch.advantages) == pytest.approx(expected_adv.tolist())
        moved = sum(a != b for a, b in zip(rewards, want, strict=True))
        assert relabelled_members([group], credit) == moved  # type: ignore[list-item]
        assert (moved == 0) == (control == "none") or want == rewards
