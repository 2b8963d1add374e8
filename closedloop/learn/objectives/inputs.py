"""What every objective reads (:class:`ObjectiveInputs`) and returns (:class:`ObjectiveOutput`).

Shape letters: B episodes, T token positions. ``advantages_B`` holds one advantage per episode,
broadcast to its action tokens. ``mask_B_T`` is 1 on action tokens (aligned with the targets).
``turn_ids_B_T`` is the turn index of each action token (needed by turn reducers, turn-level
ratios and the turn clip fraction). Values of any input off the mask are ignored (NaN padding is
fine) and get zero gradient; on the mask every log-prob and advantage must be finite.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from closedloop.learn.credit import LearnError
from closedloop.learn.kl import KLSpec
from closedloop.learn.reducers import MaskError, reducer_weights, turn_slot_ids

__all__ = ["NonFiniteLogprobError", "ObjectiveInputs", "ObjectiveOutput", "PreparedBatch",
           "prepare"]


class NonFiniteLogprobError(LearnError):
    """A log-prob or advantage on an action token is missing or not finite."""


@dataclass(frozen=True, eq=False)
class ObjectiveInputs:
    """One batch as an objective sees it; the three policies are kept apart.

    ``new_logprobs_B_T``: log πθ (being updated; the only input that carries grad).
    ``behavior_logprobs_B_T``: log π_beh (sampled the tokens; the importance-ratio denominator).
    ``ref_logprobs_B_T``: log π_ref (only for KL; never an importance denominator).
    ``reducer`` names the loss reducer (:mod:`closedloop.learn.reducers`); ``weights_B_T``
    optionally supplies its per-token weights precomputed over a larger batch (gradient
    accumulation: pass the micro-batch's rows of the full batch's weights, and the micro-batch
    losses sum to the full-batch loss). ``kl_spec`` places KL in the loss (β > 0);
    ``reward_kl_spec`` names a KL applied in the reward instead (monitoring only here).
    ``length_band_edges`` (e0, e1) split episodes by action-token count for the gradient-mass
    shares: short T_i <= e0, medium e0 < T_i <= e1, long T_i > e1.
    """

    new_logprobs_B_T: torch.Tensor
    behavior_logprobs_B_T: torch.Tensor
    advantages_B: torch.Tensor
    mask_B_T: torch.Tensor
    turn_ids_B_T: torch.Tensor | None = None
    success_B: torch.Tensor | None = None
    ref_logprobs_B_T: torch.Tensor | None = None
    entropy_B_T: torch.Tensor | None = None
    reducer: str = "episode_sum"
    kl_spec: KLSpec | None = None
    reward_kl_spec: KLSpec | None = None
    length_band_edges: tuple[int, int] = (64, 256)
    weights_B_T: torch.Tensor | None = None


class ObjectiveOutput(NamedTuple):
    """Named outputs of an objective. Only ``loss`` carries grad; the rest are detached.

    ``pg_loss`` and ``kl`` are the reduced terms with ``loss = pg_loss + β·kl`` when KL is
    placed in the loss. ``kl`` is reduced with the objective's reducer; ``kl_token_mean`` is
    the plain mean over action tokens (comparable across reducers). Both are computed whenever
    ref log-probs are given, with the estimator of ``kl_spec``, else of ``reward_kl_spec``,
    else k3 (then they are monitoring only).

    Gradient mass uses the per-token coefficient c_it = ∂loss/∂log πθ(a_it), computed
    analytically (no backward); ``grad_coef_B_T`` holds it. The mass of episode i is
    m_i = Σ_t |c_it|, ``grad_mass_total`` is Σ_i m_i and the other ``grad_mass_*`` fields are
    shares of it in [0, 1] (successful vs failed episodes, length bands).

    Metrics that are undefined (no action tokens, no reference log-probs, no clipping in the
    objective, no turn ids, no success labels, no gradient mass) are ``None``, never 0.
    """

    loss: torch.Tensor
    pg_loss: float
    kl: float | None
    kl_token_mean: float | None
    entropy: float | None
    clip_frac_token: float | None
    clip_frac_turn: float | None
    clip_frac_episode: float | None
    ratio_p50: float | None
    ratio_p95: float | None
    ratio_p99: float | None
    ratio_max: float | None
    abs_log_ratio_mean: float | None
    abs_log_ratio_max: float | None
    grad_mass_total: float
    grad_mass_success: float | None
    grad_mass_failure: float | None
    grad_mass_short: float | None
    grad_mass_medium: float | None
    grad_mass_long: float | None
    grad_coef_B_T: torch.Tensor
    n_episodes: int
    n_action_tokens: int
    n_empty_episodes: int
    objective: str
    reducer: str
    kl_spec: KLSpec | None
    reward_kl_spec: KLSpec | None

    def metrics(self) -> dict[str, float | int | None]:
        """Scalar metrics, namespaced for logging (``losses/…``, ``clip/…``, ``ratio/…``, …)."""
        out: dict[str, float | int | None] = {"losses/loss": float(self.loss.detach())}
        for name, group in _METRIC_GROUPS.items():
            out[f"{group}/{name}"] = getattr(self, name)
        return out


_METRIC_GROUPS: dict[str, str] = {
    **dict.fromkeys(("pg_loss", "kl", "kl_token_mean", "entropy"), "losses"),
    **dict.fromkeys(("clip_frac_token", "clip_frac_turn", "clip_frac_episode"), "clip"),
    **dict.fromkeys(("ratio_p50", "ratio_p95", "ratio_p99", "ratio_max", "abs_log_ratio_mean",
                     "abs_log_ratio_max"), "ratio"),
    **dict.fromkeys(("grad_mass_total", "grad_mass_success", "grad_mass_failure",
                     "grad_mass_short", "grad_mass_medium", "grad_mass_long"), "grad_mass"),
    **dict.fromkeys(("n_episodes", "n_action_tokens", "n_empty_episodes"), "batch"),
}


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
    )
