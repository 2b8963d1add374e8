"""Turn-level credit: hand-worked GAE and returns, the termination taxonomy's bootstrap rule, the
broadcast onto a turn's own action tokens, per-token advantages in the objectives, and the TD
telescoping identity on recorded key-and-door episodes with the recurrent critic's values."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from closedloop.contracts import Termination
from closedloop.contracts.update import ObjectiveInputs
from closedloop.errors import LearnError, MaskError
from closedloop.learn import ppo_clip, reinforce_with_kl, returns_to_go
from closedloop.learn.ac_update import turn_batch
from closedloop.learn.turn_credit import (
    BOOTSTRAP_CODES,
    EXCLUDED_CODES,
    broadcast_turn_values,
    episode_boundary,
    gae,
    td_residuals,
    telescoping_gap,
    turn_rewards,
)
from tests.learn.keydoor_traces import collect_keydoor, feature_policy, keydoor, keydoor_tasks


def t64(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_gae_hand_worked_terminal_and_truncated() -> None:
    # γ=.9 λ=.5, r=[0,1], V=[.5,.6,.7]. Terminal: V'(h_2)=0, δ=[.9*.6-.5, 1-.6]=[.04,.4],
    # A1=.4, A0=.04+.45*.4=.22. Truncated: δ1=1+.9*.7-.6=1.03, A0=.04+.45*1.03=.5035.
    r, v = t64([0.0, 1.0]), t64([0.5, 0.6, 0.7])
    term = gae(r, v, 0.9, 0.5, bootstrap=False)
    torch.testing.assert_close(term.deltas_K, t64([0.04, 0.4]))
    torch.testing.assert_close(term.advantages_K, t64([0.22, 0.4]))
    torch.testing.assert_close(term.returns_K, t64([0.72, 1.0]))
    trunc = gae(r, v, 0.9, 0.5, bootstrap=True)
    torch.testing.assert_close(trunc.advantages_K, t64([0.5035, 1.03]))


def test_gae_limits_are_returns_and_residuals() -> None:
    r, v = t64([0.2, 0.0, 0.5]), t64([0.3, -0.1, 0.4, 0.9])
    # λ=1: A_k = G_k + γ^{K-k} V'(h_K) - V(h_k); with G = [.52, .4, .5] at γ=.8 (seed example)
    g = returns_to_go(r, 0.8)
    torch.testing.assert_close(g, t64([0.52, 0.4, 0.5]))
    one = gae(r, v, 0.8, 1.0, bootstrap=False).advantages_K
    torch.testing.assert_close(one, g - v[:-1])
    boot = gae(r, v, 0.8, 1.0, bootstrap=True).advantages_K
    torch.testing.assert_close(boot, g + 0.8 ** t64([3.0, 2.0, 1.0]) * 0.9 - v[:-1])
    zero = gae(r, v, 0.8, 0.0, bootstrap=True)
    torch.testing.assert_close(zero.advantages_K, td_residuals(r, v, 0.8, True))


def test_the_termination_taxonomy_decides_the_bootstrap() -> None:
    for code in Termination:
        bound = episode_boundary(code, 4)
        if code in EXCLUDED_CODES:
            assert bound is None
        elif code == Termination.MAX_TOKEN_TRUNCATION:
            assert bound == (3, True)  # the cut-off last action was never executed
        else:
            assert bound == (4, code in BOOTSTRAP_CODES)
            assert bound.bootstrap == (not code.is_terminal)
    assert episode_boundary(Termination.MAX_STEP_TRUNCATION, 4) == (4, True)


def test_turn_rewards_never_score_a_truncated_episode() -> None:
    torch.testing.assert_close(turn_rewards(3, 1.0, False), t64([0.0, 0.0, 1.0]))
    torch.testing.assert_close(turn_rewards(2, 0.0, False, [0.1, -0.2]), t64([0.1, -0.2]))
    torch.testing.assert_close(turn_rewards(2, None, True, [0.1, 0.3]), t64([0.1, 0.3]))
    with pytest.raises(LearnError):
        turn_rewards(2, 0.0, True)  # unscored is never 0
    with pytest.raises(LearnError):
        turn_rewards(2, None, False)
    with pytest.raises(LearnError):
        gae(t64([1.0]), t64([0.0]), 0.9, 0.9, False)  # K+1 values needed


def test_turn_advantages_land_on_their_own_action_tokens_only() -> None:
    # the chapter's layout S S S | A A | O O O O | A A; returns-to-go [.52, .5] per turn
    mask = torch.tensor([[0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1]], dtype=torch.float32)
    turns = torch.tensor([[-1, -1, -1, 0, 0, -1, -1, -1, -1, 1, 1]])
    g = torch.tensor([[0.52, 0.5]])
    got = broadcast_turn_values(g, turns, mask)
    torch.testing.assert_close(got, torch.tensor([[0, 0, 0, .52, .52, 0, 0, 0, 0, .5, .5]]))
    with pytest.raises(MaskError):
        broadcast_turn_values(g, torch.tensor([[-1, -1, -1, 0, 0, -1, -1, -1, -1, 2, 2]]), mask)


def _inputs(adv_B: torch.Tensor, token_adv: torch.Tensor | None, new: torch.Tensor
            ) -> ObjectiveInputs:
    mask = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1]], dtype=torch.float32)
    return ObjectiveInputs(new_logprobs_B_T=new, behavior_logprobs_B_T=new.detach() - 0.05,
                           advantages_B=adv_B, mask_B_T=mask,
                           turn_ids_B_T=torch.tensor([[0, 0, -1, 1], [0, -1, 1, 1]]),
                           token_advantages_B_T=token_adv)


@pytest.mark.parametrize("objective", [reinforce_with_kl, ppo_clip])
def test_per_token_advantages_replace_the_broadcast(objective) -> None:
    new = torch.log(torch.tensor([[0.5, 0.4, 0.9, 0.3], [0.2, 0.9, 0.6, 0.7]]))
    adv = torch.tensor([1.0, -2.0])
    same = adv[:, None].expand(2, 4).clone()
    a = objective(_inputs(adv, None, new.clone().requires_grad_()))
    b = objective(_inputs(adv, same, new.clone().requires_grad_()))
    assert float(a.loss.detach()) == pytest.approx(float(b.loss.detach()))
    torch.testing.assert_close(a.grad_coef_B_T, b.grad_coef_B_T)
    # turn 0 of episode 0 gets +1, its turn 1 gets -3: the coefficients follow token by token
    per_turn = torch.tensor([[1.0, 1.0, 0.0, -3.0], [0.5, 0.0, -1.0, -1.0]])
    c = objective(_inputs(adv, per_turn, new.clone().requires_grad_()))
    if objective is reinforce_with_kl:  # L = (1/B) Σ -A_it log π_it (episode_sum)
        expect = -(per_turn * new * _inputs(adv, None, new).mask_B_T).sum() / 2
        assert float(c.loss.detach()) == pytest.approx(float(expect))
        torch.testing.assert_close(c.grad_coef_B_T, -per_turn / 2 * _inputs(adv, None,
                                                                           new).mask_B_T)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=0, max_size=12), st.floats(0, 1),
       st.data())
def test_td_telescoping_holds_for_any_values(rewards, gamma, data) -> None:
    values = data.draw(st.lists(st.floats(-5, 5), min_size=len(rewards) + 1,
                                max_size=len(rewards) + 1))
    lhs, rhs = telescoping_gap(t64(rewards), t64(values), gamma)
    assert lhs == pytest.approx(rhs, abs=1e-9)


def test_td_telescoping_on_recorded_keydoor_episodes() -> None:
    """Real traces (the collector, the verifier, truncations included) and the recurrent
    critic's V(h_0 … h_K): Σ γ^k δ_k = G_0 - V(h_0) + γ^K V(h_K) on every episode."""
    train, _ = keydoor_tasks(6, 2)
    model = feature_policy(seed=3)
    episodes = collect_keydoor(model, train, group_size=4, max_turns=3)  # some truncated
    episodes += collect_keydoor(model, train, group_size=4, max_turns=12, salt=1)
    codec = keydoor().feature_codec
    assert codec is not None
    batch = turn_batch(episodes, codec)
    assert bool(batch.bootstrap_B.any()) and not bool(batch.bootstrap_B.all())
    with torch.no_grad():
        _, values = model.unroll(batch.features_B_K1_F, batch.actions_B_K1, batch.masks_B_K1_A)
    for i in range(len(batch.episode_ids)):
        n = int(batch.n_turns_B[i])
        r, v = batch.rewards_B_K[i, :n], values[i, : n + 1].double()
        lhs, rhs = telescoping_gap(r, v, 0.95)
        assert lhs == pytest.approx(rhs, abs=1e-9)
        # and with the terminal value zeroed (a terminal episode), the residuals sum to G_0 - V_0
        if not bool(batch.bootstrap_B[i]):
            d = td_residuals(r, v, 0.95, bootstrap=False)
            disc = 0.95 ** torch.arange(n, dtype=torch.float64)
            g0 = float(returns_to_go(r, 0.95)[0])
            assert float((disc * d).sum()) == pytest.approx(g0 - float(v[0]), abs=1e-9)
