"""Potential-based reward shaping over turns (potential-based shaping, docs/credit.md).

For a potential Φ over states and the discount γ of the return, turn k's shaping term is

    F_k = γ Φ'(s_{k+1}) - Φ(s_k),        r'_k = r_k + F_k,

with the terminal convention Φ'(s_K) = 0 when the episode ended in a terminal state (the
absorbing state after the end has potential 0; a truncated episode keeps Φ'(s_K) = Φ(s_K)).
The discounted shaping terms telescope:

    Σ_{k<K} γ^k F_k = -Φ(s_0) + γ^K Φ'(s_K),

so a terminal episode's shaped return is its return minus Φ(s_0): the shaping moves credit
between turns and changes the return only by that boundary term. Under the classical
conditions (the same γ, Φ over the Markov state, the stopping rule unchanged) this preserves
the optimal policies; it does not promise faster learning. Φ here is over the true state (the
environment package's ``potential``), not over the agent's observations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from closedloop.contracts import AgentEnv, Episode
from closedloop.contracts.package import Potential
from closedloop.errors import LearnError
from closedloop.learn.turn_credit import episode_boundary
from closedloop.rollout.prefix import boundary_states

__all__ = ["EpisodeShaping", "recorded_shaping", "shaping_telescoping", "shaping_terms"]


def _potentials(potentials: Sequence[float], terminal: bool) -> torch.Tensor:
    phi = torch.as_tensor(list(potentials), dtype=torch.float64)
    if phi.dim() != 1 or phi.numel() < 1:
        raise LearnError("potentials need one value per boundary s_0 … s_K (at least s_0)")
    if not bool(torch.isfinite(phi).all()):
        raise LearnError(f"potentials must be finite, got {phi.tolist()}")
    if terminal:
        phi = phi.clone()
        phi[-1] = 0.0
    return phi


def shaping_terms(potentials: Sequence[float], gamma: float, terminal: bool) -> torch.Tensor:
    """F_k = γ Φ'(s_{k+1}) - Φ(s_k) for k < K, from Φ(s_0) … Φ(s_K) (K+1 values).

    ``terminal``: the episode ended in a terminal state, so Φ'(s_K) = 0 (else Φ(s_K)).
    Hand-worked (γ = .9, terminal): Φ = [0, .2, .5, 1.0] gives F = [.18, .25, -.5].
    """
    if not 0.0 <= gamma <= 1.0:
        raise LearnError(f"gamma must lie in [0, 1], got {gamma}")
    phi = _potentials(potentials, terminal)
    return gamma * phi[1:] - phi[:-1]


def shaping_telescoping(potentials: Sequence[float], gamma: float,
                        terminal: bool) -> tuple[float, float]:
    """Both sides of the telescoping identity: (Σ_k γ^k F_k, -Φ(s_0) + γ^K Φ'(s_K))."""
    terms = shaping_terms(potentials, gamma, terminal)
    phi = _potentials(potentials, terminal)
    k = terms.numel()
    lhs = float((gamma ** torch.arange(k, dtype=torch.float64) * terms).sum())
    return lhs, -float(phi[0]) + gamma**k * float(phi[-1])


class EpisodeShaping(NamedTuple):
    """The shaping of one recorded episode: Φ(s_0) … Φ(s_K) as the package computes them
    (before the terminal convention), whether s_K is terminal, the terms F_0 … F_{K-1}, and
    both sides of the telescoping identity."""

    potentials: tuple[float, ...]
    terminal: bool
    terms: tuple[float, ...]
    discounted_sum: float
    boundary_term: float


def recorded_shaping(episode: Episode, env: AgentEnv, potential: Potential,
                     gamma: float) -> EpisodeShaping | None:
    """Φ at every boundary of a recorded episode (its states rebuilt by verified replay in
    ``env``, ``closedloop.rollout.prefix.boundary_states``), the shaping terms and the identity.
    ``None`` for an episode that gets no credit (a system event)."""
    traj = episode.trajectory
    bound = episode_boundary(traj.termination, len(episode.turns))
    if bound is None:
        return None
    states = boundary_states(episode, env)[: bound.n_turns + 1]
    phi = tuple(float(potential(traj.task_id, s)) for s in states)
    terminal = not bound.bootstrap
    terms = shaping_terms(phi, gamma, terminal)
    lhs, rhs = shaping_telescoping(phi, gamma, terminal)
    return EpisodeShaping(phi, terminal, tuple(float(x) for x in terms), lhs, rhs)
