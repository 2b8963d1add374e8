"""Turn-level credit: returns, TD residuals and GAE over an episode's turns, and the broadcast
of turn advantages onto that turn's action tokens only (turn-level credit, docs/credit.md).

An episode of K executed turns has histories h_0 … h_K at its turn boundaries (h_k: what the
policy saw before action k; h_K: after the last observation), rewards r_0 … r_{K-1} (r_k is
received after action k) and values V(h_0) … V(h_K) from a critic. With discount γ and GAE
parameter λ:

    G_k = Σ_{j≥k} γ^{j-k} r_j                                   (return-to-go)
    δ_k = r_k + γ V'(h_{k+1}) - V(h_k)                           (TD residual)
    A_k = Σ_{l≥0} (γλ)^l δ_{k+l}                                 (GAE)
    R^λ_k = A_k + V(h_k)                                          (the critic's target)

where V'(h_K) = 0 when the episode ended in a terminal state and V'(h_K) = V(h_K) when it was
truncated (the bootstrap); V'(h_k) = V(h_k) for k < K. The termination code decides which
(:func:`episode_boundary`): the four terminal codes are not bootstrapped; the collector's
truncations (``max_step_truncation``; ``max_token_truncation``, whose cut-off last action was
never executed and gets no credit) are; system events (tool timeout, infra abort, scheduler
cancel) are excluded from credit altogether. A truncated episode carries no outcome reward
(unscored is never 0): its return beyond h_K is the bootstrap value alone.

TD telescoping (an implementation check, not a causal diagnosis): with V' = V everywhere,

    Σ_k γ^k δ_k = G_0 - V(h_0) + γ^K V(h_K)

(:func:`telescoping_gap` returns both sides). λ = 1 gives A_k = G_k + γ^{K-k} V'(h_K) - V(h_k);
λ = 0 gives A_k = δ_k.

Shape letters: B episodes, K turns (K+1 boundaries), T token positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from closedloop.contracts import Termination
from closedloop.errors import LearnError, MaskError
from closedloop.learn.credit import returns_to_go

__all__ = [
    "BOOTSTRAP_CODES",
    "EXCLUDED_CODES",
    "EpisodeBoundary",
    "TurnGAE",
    "broadcast_turn_values",
    "episode_boundary",
    "gae",
    "td_residuals",
    "telescoping_gap",
    "turn_rewards",
    "turn_table",
]

BOOTSTRAP_CODES = frozenset({Termination.MAX_STEP_TRUNCATION, Termination.MAX_TOKEN_TRUNCATION})
"""Truncations imposed by the collector: the task could have gone on, so V(h_K) bootstraps."""
EXCLUDED_CODES = frozenset({Termination.TOOL_TIMEOUT, Termination.INFRA_ABORT,
                            Termination.SCHEDULER_CANCEL})
"""System events: nothing the policy did ended the episode; it gets no credit at all."""


class EpisodeBoundary(NamedTuple):
    """How an episode ends for turn credit.

    ``n_turns``: the turns that were executed and get credit (a ``max_token_truncation``
    episode's last action was cut off and never executed: it is not counted). ``bootstrap``:
    True when V(h_K) bootstraps the return (truncated), False when V(h_K) = 0 (terminal).
    """

    n_turns: int
    bootstrap: bool


def episode_boundary(termination: Termination, num_turns: int) -> EpisodeBoundary | None:
    """The boundary rule of the module docstring; ``None`` for a system event (excluded)."""
    if num_turns < 0:
        raise LearnError(f"num_turns must be >= 0, got {num_turns}")
    if termination in EXCLUDED_CODES:
        return None
    if termination == Termination.MAX_TOKEN_TRUNCATION:
        return EpisodeBoundary(max(num_turns - 1, 0), True)
    return EpisodeBoundary(num_turns, termination in BOOTSTRAP_CODES)


def turn_rewards(n_turns: int, outcome: float | None, bootstrap: bool,
                 step_rewards: Sequence[float] | None = None) -> torch.Tensor:
    """Per-turn rewards r_0 … r_{K-1} of one episode (float64).

    ``step_rewards`` (length K) are rewards received after each turn (e.g. shaping terms; zero
    when omitted); a terminal episode adds its verified ``outcome`` to the last turn's reward.
    A truncated (``bootstrap``) episode must have ``outcome`` None: it was never scored.
    """
    r = torch.zeros(n_turns, dtype=torch.float64)
    if step_rewards is not None:
        if len(step_rewards) != n_turns:
            raise LearnError(f"step_rewards has {len(step_rewards)} entries for {n_turns} turns")
        r += torch.as_tensor(list(step_rewards), dtype=torch.float64)
    if bootstrap:
        if outcome is not None:
            raise LearnError("a truncated episode has no outcome reward (unscored, never 0)")
        return r
    if outcome is None:
        raise LearnError("a terminal episode needs its verified outcome reward")
    if n_turns == 0:
        raise LearnError("a terminal episode with no executed turn has nothing to credit")
    r[-1] += float(outcome)
    return r


def _check(rewards_K: torch.Tensor, values_K1: torch.Tensor, gamma: float) -> None:
    if not 0.0 <= gamma <= 1.0:
        raise LearnError(f"gamma must lie in [0, 1], got {gamma}")
    if rewards_K.dim() != 1 or values_K1.dim() != 1:
        raise LearnError("rewards_K and values_K1 must be 1-D")
    if values_K1.numel() != rewards_K.numel() + 1:
        raise LearnError(f"values_K1 needs K+1 = {rewards_K.numel() + 1} entries (one per turn "
                         f"boundary), got {values_K1.numel()}")
    if not (bool(torch.isfinite(rewards_K).all()) and bool(torch.isfinite(values_K1).all())):
        raise LearnError("rewards and values must be finite")


def td_residuals(rewards_K: torch.Tensor, values_K1: torch.Tensor, gamma: float,
                 bootstrap: bool) -> torch.Tensor:
    """δ_k = r_k + γ V'(h_{k+1}) - V(h_k), V'(h_K) = 0 unless ``bootstrap`` (module docstring).

    Shapes: [K], [K+1] -> [K].
    """
    _check(rewards_K, values_K1, gamma)
    nxt = values_K1[1:].clone()
    if not bootstrap and nxt.numel():
        nxt[-1] = 0.0
    return rewards_K + gamma * nxt - values_K1[:-1]


class TurnGAE(NamedTuple):
    """GAE of one episode: ``advantages_K`` (A_k), ``returns_K`` (R^λ_k = A_k + V(h_k), the
    critic's regression target) and ``deltas_K`` (δ_k)."""

    advantages_K: torch.Tensor
    returns_K: torch.Tensor
    deltas_K: torch.Tensor


def gae(rewards_K: torch.Tensor, values_K1: torch.Tensor, gamma: float, lam: float,
        bootstrap: bool) -> TurnGAE:
    """Turn-level GAE: A_k = δ_k + γλ A_{k+1}, A_K = 0 (module docstring).

    Hand-worked (γ = .9, λ = .5, terminal): r = [0, 1], V = [.5, .6, .7] gives
    δ = [0 + .9·.6 - .5, 1 + 0 - .6] = [.04, .4], A = [.04 + .45·.4, .4] = [.22, .4].
    """
    if not 0.0 <= lam <= 1.0:
        raise LearnError(f"lambda must lie in [0, 1], got {lam}")
    deltas = td_residuals(rewards_K, values_K1, gamma, bootstrap)
    adv = torch.empty_like(deltas)
    running = deltas.new_zeros(())
    for k in range(deltas.numel() - 1, -1, -1):
        running = deltas[k] + gamma * lam * running
        adv[k] = running
    return TurnGAE(adv, adv + values_K1[:-1], deltas)


def telescoping_gap(rewards_K: torch.Tensor, values_K1: torch.Tensor,
                    gamma: float) -> tuple[float, float]:
    """Both sides of the TD telescoping identity, without zeroing V(h_K):
    (Σ_k γ^k δ_k, G_0 - V(h_0) + γ^K V(h_K)). They agree up to float rounding for any V."""
    deltas = td_residuals(rewards_K, values_K1, gamma, bootstrap=True)
    k = rewards_K.numel()
    disc = gamma ** torch.arange(k, dtype=rewards_K.dtype)
    lhs = float((disc * deltas).sum())
    g0 = float(returns_to_go(rewards_K, gamma)[0]) if k else 0.0
    rhs = g0 - float(values_K1[0]) + gamma**k * float(values_K1[-1])
    return lhs, rhs


def turn_table(rows: Sequence[Sequence[float]]) -> torch.Tensor:
    """Ragged per-turn values (one row per episode) as a [B, K_max] float32 tensor, 0-padded."""
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([list(r) + [0.0] * (width - len(r)) for r in rows],
                        dtype=torch.float32).reshape(len(rows), width)


def broadcast_turn_values(turn_values_B_K: torch.Tensor, turn_ids_B_T: torch.Tensor,
                          mask_B_T: torch.Tensor) -> torch.Tensor:
    """Paint each turn's value onto that turn's action tokens; 0 on every other position.

    ``turn_values_B_K[i, k]`` is turn k of episode i's value (an advantage, a return);
    ``turn_ids_B_T`` the turn index of each action token (-1 elsewhere, as in
    ``TrainingBatch``); ``mask_B_T`` 1 on the tokens that take credit. A masked-in token whose
    turn has no column raises ``MaskError``. Shapes: [B, K], [B, T], [B, T] -> [B, T].
    """
    if turn_ids_B_T.shape != mask_B_T.shape or turn_values_B_K.dim() != 2 or (
            turn_values_B_K.shape[0] != mask_B_T.shape[0]):
        raise MaskError(f"shapes do not agree: values {tuple(turn_values_B_K.shape)}, turn ids "
                        f"{tuple(turn_ids_B_T.shape)}, mask {tuple(mask_B_T.shape)}")
    on = mask_B_T > 0
    ids = turn_ids_B_T.long()
    n_turns = turn_values_B_K.shape[1]
    if bool(((ids < 0) & on).any()) or bool(((ids >= n_turns) & on).any()):
        raise MaskError(f"an action token's turn id lies outside 0..{n_turns - 1}")
    if n_turns == 0:
        return torch.zeros(mask_B_T.shape, dtype=turn_values_B_K.dtype)
    gathered = turn_values_B_K.gather(1, ids.clamp(0, n_turns - 1))
    return torch.where(on, gathered, torch.zeros((), dtype=turn_values_B_K.dtype))
