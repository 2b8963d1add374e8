"""Validation of an objective's batch: :func:`prepare` turns one
:class:`~closedloop.contracts.update.ObjectiveInputs` into a :class:`PreparedBatch` (shapes,
dtypes and finiteness on the mask checked; every input zeroed off the mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from closedloop.contracts.update import ObjectiveInputs
from closedloop.errors import LearnError, MaskError, NonFiniteLogprobError
from closedloop.learn.reducers import reducer_weights, turn_slot_ids

__all__ = ["NonFiniteLogprobError", "PreparedBatch", "prepare"]


@dataclass(frozen=True)
class PreparedBatch:
    """Validated inputs, zero off the mask (``on``), in ``new``'s dtype; ``weights`` are the
    reducer's per-token weights (the caller's precomputed ones when given)."""

    new: torch.Tensor
    beh: torch.Tensor
    ref: torch.Tensor | None
    adv_B: torch.Tensor
    on: torch.Tensor
    turn_ids: torch.Tensor | None
    success_B: torch.Tensor | None
    entropy: torch.Tensor | None
    weights: torch.Tensor
    prox: torch.Tensor | None = None


def _on_mask(x: torch.Tensor, on: torch.Tensor, name: str) -> torch.Tensor:
    if x.shape != on.shape:
        raise MaskError(f"{name} shape {tuple(x.shape)} != mask shape {tuple(on.shape)}")
    if not bool(torch.isfinite(x[on]).all()):
        raise NonFiniteLogprobError(f"{name} is not finite on an action token")
    return torch.where(on, x, torch.zeros((), dtype=x.dtype))


def _check_per_episode(x: torch.Tensor | None, b: int, name: str) -> None:
    if x is not None and x.shape != (b,):
        raise MaskError(f"{name} must have shape [{b}], got {tuple(x.shape)}")


def _weights(inputs: ObjectiveInputs, on: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    w = inputs.weights_B_T
    if w is None:
        return reducer_weights(inputs.reducer, on, inputs.turn_ids_B_T, dtype=dtype)
    if w.shape != on.shape:
        raise MaskError(f"weights_B_T shape {tuple(w.shape)} != mask shape {tuple(on.shape)}")
    if bool((w[~on] != 0).any()) or bool((w < 0).any()):
        raise MaskError("weights_B_T must be >= 0 and exactly 0 off the mask")
    return w.detach().to(dtype)


def prepare(inputs: ObjectiveInputs) -> PreparedBatch:
    """Validate shapes, dtypes and finiteness on the mask; zero every input off it."""
    mask, new = inputs.mask_B_T, inputs.new_logprobs_B_T
    if mask.dim() != 2:
        raise MaskError(f"mask_B_T must be 2-D [B, T], got shape {tuple(mask.shape)}")
    if not new.is_floating_point():
        raise LearnError(f"new_logprobs_B_T must be floating point, got {new.dtype}")
    on = mask > 0
    b = mask.shape[0]
    _check_per_episode(inputs.advantages_B, b, "advantages_B")
    _check_per_episode(inputs.success_B, b, "success_B")
    if not bool(torch.isfinite(inputs.advantages_B).all()):
        raise NonFiniteLogprobError("advantages_B holds a non-finite value")
    if inputs.turn_ids_B_T is not None:
        turn_slot_ids(mask, inputs.turn_ids_B_T)  # validates shape, dtype and sign
    ref, ent = inputs.ref_logprobs_B_T, inputs.entropy_B_T
    return PreparedBatch(
        new=_on_mask(new, on, "new_logprobs_B_T"),
        beh=_on_mask(inputs.behavior_logprobs_B_T.detach().to(new.dtype), on,
                     "behavior_logprobs_B_T"),
        ref=None if ref is None else _on_mask(ref.detach().to(new.dtype), on, "ref_logprobs_B_T"),
        adv_B=inputs.advantages_B.detach().to(new.dtype),
        on=on,
        turn_ids=inputs.turn_ids_B_T,
        success_B=inputs.success_B,
        entropy=None if ent is None else _on_mask(ent.detach(), on, "entropy_B_T"),
        weights=_weights(inputs, on, new.dtype),
        prox=None if inputs.proximal_logprobs_B_T is None else _on_mask(
            inputs.proximal_logprobs_B_T.detach().to(new.dtype), on, "proximal_logprobs_B_T"),
    )
