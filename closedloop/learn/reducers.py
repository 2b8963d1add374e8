"""Explicit loss reducers: which tokens, turns or episodes get equal weight (docs/concepts.md,
loss reductions).

Every reducer here is *linear* in the per-token loss terms: it computes a coefficient
``weights_B_T[i, t]`` for each token and returns ``L = Σ_{i,t} weights_B_T[i,t] · ℓ_{i,t}``. The
coefficients depend only on the mask and the turn ids, never on ℓ, so the gradient of L with
respect to a token's term is exactly its weight — which is what gradient-mass reports use.

Shape letters: B episodes (rows), T token positions, K turns. ``mask_B_T`` is 1 on action tokens
(already aligned with the targets), 0 elsewhere. ``turn_ids_B_T`` gives the turn index of each
action token (-1, or anything, off the mask: only masked-in positions are read). T_i is the
number of action tokens of episode i, K_i its number of turns with at least one action token,
T_ik the action tokens of turn k.

- ``episode_sum``: L = (1/B) Σ_i Σ_t ℓ. The score-function estimand (expected episode return).
- ``length_normalized``: L = (1/B) Σ_i (1/T_i) Σ_t ℓ. Surrogate: equal mass per episode.
- ``token_mean``: L = (1/Σ_i T_i) Σ_i Σ_t ℓ. Surrogate: equal mass per batch token.
- ``turn_mass_conserving``: L = (1/B) Σ_i (1/K_i) Σ_k (1/T_ik) Σ_{t∈k} ℓ. Surrogate: equal
  mass per episode, split equally among its turns, then equally among each turn's tokens.
- ``turn_mean``: L = (1/Σ_i K_i) Σ_i Σ_k (1/T_ik) Σ_{t∈k} ℓ. Surrogate: equal mass per turn
  in the batch; episodes with more turns get more mass.

Every weight factors as w_it = c(batch) · u_it, where u_it depends only on row i (1, 1/T_i,
1/(K_i T_ik) or 1/T_ik) and c is one batch-wide constant (1/B, 1/Σ_i T_i or 1/Σ_i K_i). So the
weights a sub-batch of rows computes for itself are proportional to that sub-batch's rows of
the full-batch weights: micro-batches can be rescaled by one scalar, or be given the full
batch's rows directly (``weights_B_T`` in :mod:`closedloop.learn.objectives`).

A row with no action tokens contributes 0 and still counts in B (it is a sampled episode that
carries no gradient). An all-empty batch gives L = 0 without dividing by zero.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Literal, NamedTuple

import torch

from closedloop.errors import MaskError, UnknownNameError

__all__ = [
    "GROUP_REWARD_SCALES",
    "REDUCERS",
    "MaskError",
    "ReducedLoss",
    "apply_group_reward_scale",
    "get_reducer",
    "reduce_loss",
    "reducer_weights",
    "turn_slot_ids",
]

GroupRewardScale = Literal["none", "std"]
WeightFn = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


class ReducedLoss(NamedTuple):
    """A reduced loss and the per-token coefficients that produced it.

    ``loss = (weights_B_T * loss_B_T).sum()`` over masked-in tokens. ``n_empty_rows`` counts
    episodes with no action token (they contribute 0 but are counted in B).
    """

    loss: torch.Tensor
    weights_B_T: torch.Tensor
    reducer: str
    n_action_tokens: int
    n_empty_rows: int


# ----------------------------------------------------------------------------- validation
def _check_mask(mask_B_T: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask_B_T.dim() != 2:
        raise MaskError(f"mask_B_T must be 2-D [B, T], got shape {tuple(mask_B_T.shape)}")
    if mask_B_T.shape[0] == 0:
        raise MaskError("mask_B_T has no rows (B = 0)")
    mask = mask_B_T.to(dtype)
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise MaskError("mask_B_T must hold only 0 and 1")
    return mask


def turn_slot_ids(mask_B_T: torch.Tensor, turn_ids_B_T: torch.Tensor | None) -> torch.Tensor:
    """Return the turn index of each action token as int64, 0 off the mask.

    Raises :class:`MaskError` when turn ids are missing, mis-shaped, or negative on an action
    token. Used to scatter tokens into dense [B, K] per-turn slots.
    """
    if turn_ids_B_T is None:
        raise MaskError("this reducer needs turn_ids_B_T (turn index per action token)")
    if turn_ids_B_T.shape != mask_B_T.shape:
        raise MaskError(
            f"turn_ids_B_T shape {tuple(turn_ids_B_T.shape)} != mask shape {tuple(mask_B_T.shape)}"
        )
    if turn_ids_B_T.is_floating_point() or turn_ids_B_T.dtype == torch.bool:
        raise MaskError(f"turn_ids_B_T must be an integer tensor, got {turn_ids_B_T.dtype}")
    on = mask_B_T > 0
    if bool((turn_ids_B_T[on] < 0).any()):
        raise MaskError("turn_ids_B_T is negative on an action token")
    return torch.where(on, turn_ids_B_T, 0).long()


def _turn_counts(
    mask: torch.Tensor, turn_ids_B_T: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token T_ik (0 off the mask) and per-row K_i."""
    slot = turn_slot_ids(mask, turn_ids_B_T)
    n_slots = int(slot.max()) + 1 if slot.numel() else 1
    counts_B_K = mask.new_zeros(mask.shape[0], n_slots).scatter_add_(1, slot, mask)
    tokens_in_turn_B_T = counts_B_K.gather(1, slot) * mask
    turns_B = (counts_B_K > 0).sum(dim=1).to(mask.dtype)
    return tokens_in_turn_B_T, turns_B


def _safe_inverse(x: torch.Tensor) -> torch.Tensor:
    """1/x where x > 0, else 0 (an empty row or batch contributes nothing)."""
    return torch.where(x > 0, 1.0 / torch.where(x > 0, x, 1.0), 0.0)


# ----------------------------------------------------------------------------- weights
def _episode_sum(mask: torch.Tensor, turn_ids: torch.Tensor | None) -> torch.Tensor:
    """Score-function estimand: w = 1/B on every action token.

    L = (1/B) Σ_i Σ_t ℓ_it. With ℓ = -A_i log π this is the REINFORCE estimate of the gradient
    of expected episode return; 1/B does not depend on any sampled length.
    """
    return mask / mask.shape[0]


def _length_normalized(mask: torch.Tensor, turn_ids: torch.Tensor | None) -> torch.Tensor:
    """Surrogate: w = 1/(B·T_i). Each episode gets equal total weight; long ones less per token."""
    lengths_B = mask.sum(dim=1, keepdim=True)
    return mask * _safe_inverse(lengths_B) / mask.shape[0]


def _token_mean(mask: torch.Tensor, turn_ids: torch.Tensor | None) -> torch.Tensor:
    """Surrogate: w = 1/Σ_i T_i. A ratio estimator over the batch's realized token count."""
    return mask * _safe_inverse(mask.sum())


def _turn_mass_conserving(mask: torch.Tensor, turn_ids: torch.Tensor | None) -> torch.Tensor:
    """Surrogate: w = 1/(B·K_i·T_ik). Each turn of episode i gets mass 1/(B·K_i)."""
    tokens_in_turn_B_T, turns_B = _turn_counts(mask, turn_ids)
    per_turn = _safe_inverse(tokens_in_turn_B_T)
    return mask * per_turn * _safe_inverse(turns_B)[:, None] / mask.shape[0]


def _turn_mean(mask: torch.Tensor, turn_ids: torch.Tensor | None) -> torch.Tensor:
    """Surrogate: w = 1/(Σ_i K_i · T_ik). Every turn in the batch gets equal mass."""
    tokens_in_turn_B_T, turns_B = _turn_counts(mask, turn_ids)
    return mask * _safe_inverse(tokens_in_turn_B_T) * _safe_inverse(turns_B.sum())


REDUCERS: Mapping[str, WeightFn] = MappingProxyType(
    {
        "episode_sum": _episode_sum,
        "length_normalized": _length_normalized,
        "token_mean": _token_mean,
        "turn_mass_conserving": _turn_mass_conserving,
        "turn_mean": _turn_mean,
    }
)
"""Per-token weight functions by reducer name; read-only. Only ``episode_sum`` is the
score-function estimand; every other entry is a different surrogate."""


def get_reducer(name: str) -> WeightFn:
    """Return the weight function of reducer ``name``; raise :class:`UnknownNameError`."""
    try:
        return REDUCERS[name]
    except KeyError:
        raise UnknownNameError("loss reducer", name, REDUCERS) from None


def reducer_weights(
    reducer: str,
    mask_B_T: torch.Tensor,
    turn_ids_B_T: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per-token coefficients [B, T] of ``reducer`` (0 off the mask); see the module table."""
    fn = get_reducer(reducer)
    mask = _check_mask(mask_B_T, dtype or torch.get_default_dtype())
    return fn(mask, turn_ids_B_T)


def reduce_loss(
    loss_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    turn_ids_B_T: torch.Tensor | None = None,
    *,
    reducer: str,
) -> ReducedLoss:
    """Reduce per-token terms ``loss_B_T`` [B, T] to a scalar with the named reducer.

    ``loss_B_T`` holds the already-weighted terms (e.g. -A_i · log π). Values off the mask are
    ignored, even if NaN or infinite (padding), and receive zero gradient.
    """
    if loss_B_T.shape != mask_B_T.shape:
        raise MaskError(
            f"loss_B_T shape {tuple(loss_B_T.shape)} != mask shape {tuple(mask_B_T.shape)}"
        )
    if not loss_B_T.is_floating_point():
        raise MaskError(f"loss_B_T must be floating point, got {loss_B_T.dtype}")
    weights = reducer_weights(reducer, mask_B_T, turn_ids_B_T, dtype=loss_B_T.dtype)
    on = mask_B_T > 0
    terms = torch.where(on, loss_B_T, torch.zeros((), dtype=loss_B_T.dtype))
    lengths = on.sum(dim=1)
    return ReducedLoss(
        loss=(weights * terms).sum(),
        weights_B_T=weights,
        reducer=reducer,
        n_action_tokens=int(lengths.sum()),
        n_empty_rows=int((lengths == 0).sum()),
    )


GROUP_REWARD_SCALES: tuple[str, ...] = ("none", "std")
"""Accepted values of ``group_reward_scale``."""


def apply_group_reward_scale(
    advantages_G: torch.Tensor,
    rewards_G: torch.Tensor,
    group_reward_scale: GroupRewardScale = "none",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Scale one group's advantages: ``none`` -> unchanged; ``std`` -> A / (std R + eps).

    ``std`` is the population std of the group's rewards. This is an objective change, not a
    stabilizer: it reweights groups by their reward scale and blows up near zero variance.
    ``apply_group_reward_scale(dr_grpo(R), R, "std")`` equals ``grpo(R)``.
    """
    if group_reward_scale == "none":
        return advantages_G
    if group_reward_scale == "std":
        return advantages_G / (rewards_G.to(advantages_G.dtype).std(correction=0) + eps)
    raise UnknownNameError("group_reward_scale", group_reward_scale, GROUP_REWARD_SCALES)
