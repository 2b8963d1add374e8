"""The policy-gradient surrogates (docs/concepts.md, three-policy contract): REINFORCE + KL,
token-level PPO clip, and the length-normalized ratio clip. Each takes one
:class:`~closedloop.contracts.update.ObjectiveInputs` (plus its own hyperparameters) and
returns one :class:`~closedloop.contracts.update.ObjectiveOutput`.

R_w below is the named reducer: Σ_{i,t} w_it · (per-token term), w from
:mod:`closedloop.learn.reducers` (or the inputs' precomputed ``weights_B_T``). The PPO-style
objectives cover π_prox = π_beh: ρ_it = exp(log πθ(a_it) - log π_beh(a_it)); ``ppo_clip`` also
takes a decoupled π_prox (``off_policy_weights``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from closedloop.contracts.update import ObjectiveInputs, ObjectiveOutput
from closedloop.errors import LearnError, MaskError
from closedloop.learn.objectives.diagnostics import finish
from closedloop.learn.objectives.inputs import PreparedBatch, prepare
from closedloop.learn.reducers import turn_slot_ids

__all__ = ["ClipRange", "Granularity", "normalized_ratio_clip", "off_policy_weights", "ppo_clip",
           "reinforce_with_kl"]

Granularity = Literal["turn", "sequence"]


@dataclass(frozen=True)
class ClipRange:
    """The trust region [1-ε, 1+ε_high] of a clipped ratio; ``eps_high`` defaults to ``eps`` (a
    larger value is DAPO's asymmetric "clip-higher"). Needs 0 < ε < 1 and ε_high > 0."""

    eps: float = 0.2
    eps_high: float | None = None

    def __post_init__(self) -> None:
        if not (0.0 < self.eps < 1.0 and self.high_eps > 0.0):
            raise LearnError(f"need 0 < clip_eps < 1 and clip_eps_high > 0, got {self.eps}, "
                             f"{self.high_eps}")

    @property
    def high_eps(self) -> float:
        """ε_high as used."""
        return self.eps if self.eps_high is None else self.eps_high

    @property
    def bounds(self) -> tuple[float, float]:
        """(1 - ε, 1 + ε_high)."""
        return 1.0 - self.eps, 1.0 + self.high_eps


def reinforce_with_kl(inputs: ObjectiveInputs) -> ObjectiveOutput:
    """REINFORCE (+ KL): L = R_w(-A_i · log πθ(a_it)) + β · R_w(k(a_it)).

    With ``reducer="episode_sum"`` the policy term is the strict synchronous baseline
    L_pg = -(1/B) Σ_i A_i Σ_{t∈M_i} log πθ(a_it): the score-function estimate for expected
    episode return. Any other reducer is a different surrogate.

    Contract: this objective has no ratio and no clipping, so it is valid only when
    π_beh = π_prox = πθ at the start of the gradient step (one optimizer step per fresh batch,
    logprob consistency gate passed). ``behavior_logprobs_B_T`` is used only to report the
    ratio πθ/π_beh, which must be ≈ 1 on fresh data; large tails mean the contract is broken.
    KL enters the loss when ``kl_spec`` (placement "loss") has β > 0. Clip fractions are None.
    """
    batch = prepare(inputs)
    adv_B_T = batch.adv_B[:, None].expand_as(batch.weights)
    pg_loss = (batch.weights * (-adv_B_T * batch.new)).sum()
    return finish("reinforce_with_kl", inputs, batch, pg_loss, -batch.weights * adv_B_T, None)


def _clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, clip: ClipRange
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-element -min(ρA, clip(ρ, lo, hi)A) and where the clip binds (zeroes the gradient)."""
    lo, hi = clip.bounds
    surrogate = -torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)
    r = ratio.detach()
    binding = ((adv > 0) & (r > hi)) | ((adv < 0) & (r < lo))
    return surrogate, binding


def ppo_clip(inputs: ObjectiveInputs, clip: ClipRange | None = None) -> ObjectiveOutput:
    """Token-level PPO clip: ℓ_it = -min(ρ_it A_i, clip(ρ_it, 1-ε, 1+ε_high) A_i), reduced by R_w.

    At ρ = 1 the gradient equals REINFORCE's. A token is *clipped* when the clip binds, i.e. its
    gradient is zeroed: (A > 0 and ρ > 1+ε_high) or (A < 0 and ρ < 1-ε); A = 0 tokens are never
    clipped. Clip fractions per token, turn (needs ``turn_ids_B_T``) and episode. Clipping
    bounds the update on sampled actions only; it does not turn stale data into on-policy data.
    ``clip`` defaults to ``ClipRange()`` (ε = 0.2).
    """
    clip = clip or ClipRange()
    batch = prepare(inputs)
    adv_B_T = batch.adv_B[:, None].expand_as(batch.weights)
    weights = batch.weights * off_policy_weights(batch, inputs.behavior_weight_cap)
    ratio = torch.exp(batch.new - (batch.beh if batch.prox is None else batch.prox))
    surrogate, binding = _clipped_surrogate(ratio, adv_B_T, clip)
    pg_loss = (weights * surrogate).sum()
    pg_coef = -weights * adv_B_T * ratio.detach() * (~binding)
    return finish("ppo_clip", inputs, batch, pg_loss, pg_coef, binding)


def off_policy_weights(batch: PreparedBatch, cap: float | None) -> torch.Tensor:
    """The decoupled objective's per-token weight w_it = π_prox/π_beh (detached), capped at
    ``cap``; 1 where π_prox is π_beh (no proximal log-probs given) and off the mask.

    With π_prox ≠ π_beh the clipped term is ℓ_it = -w_it · min(r_it A_i, clip(r_it) A_i),
    r_it = πθ/π_prox: w corrects the sampling distribution from π_beh to π_prox, the clip
    bounds the step around π_prox, and their product at the first step is the importance
    ratio πθ/π_beh (three policies, docs/concepts.md).
    """
    if batch.prox is None:
        return torch.ones_like(batch.weights)
    w = torch.exp(batch.prox - batch.beh)
    if cap is not None:
        w = w.clamp(max=cap)
    return torch.where(batch.on, w, torch.zeros((), dtype=w.dtype)).detach()


def _unit_ids(batch: PreparedBatch, granularity: Granularity) -> tuple[torch.Tensor, int]:
    """Flat unit index per token (episode, or episode × turn slot) and the number of slots."""
    b = batch.on.shape[0]
    rows = torch.arange(b, device=batch.on.device)[:, None].expand_as(batch.on)
    if granularity == "sequence":
        return rows.reshape(-1), b
    if granularity != "turn":
        raise LearnError(f"granularity must be 'turn' or 'sequence', got {granularity!r}")
    if batch.turn_ids is None:
        raise MaskError("granularity 'turn' needs turn_ids_B_T")
    slot = turn_slot_ids(batch.on, batch.turn_ids)
    n_slots = int(slot.max()) + 1 if slot.numel() else 1
    return (rows * n_slots + slot).reshape(-1), b * n_slots


def normalized_ratio_clip(inputs: ObjectiveInputs, granularity: Granularity,
                          clip: ClipRange | None = None) -> ObjectiveOutput:
    """Geometric-mean ratio clipped per turn or per sequence (GSPO-like). A *surrogate*.

    For each unit u (a turn, or a whole episode's action tokens) with T_u action tokens,
    s_u = exp((1/T_u) Σ_{t∈u} log ρ_t) and L_u = -min(s_u A_i, clip(s_u, 1-ε, 1+ε_high) A_i).
    L_u is broadcast to each token of u and reduced by R_w; with ``length_normalized``
    (granularity "sequence") or ``turn_mass_conserving`` (granularity "turn") every unit of an
    episode gets equal weight, which is GSPO's form. s_u is a length-normalized stability score,
    not the change-of-measure ratio Π_t ρ_t: this objective deliberately changes the target and
    gives no unbiased off-policy correction. A unit is clipped when the clip binds (as in
    :func:`ppo_clip`); a token counts as clipped when its unit is, so clip_frac_token is the
    share of action tokens in clipped units and clip_frac_turn / clip_frac_episode are the
    shares of turns / episodes holding one.
    """
    clip = clip or ClipRange()
    batch = prepare(inputs)
    weights = batch.weights
    unit, n_units = _unit_ids(batch, granularity)
    on = batch.on.reshape(-1).to(batch.new.dtype)
    log_ratio = (batch.new - batch.beh).reshape(-1)
    tokens_U = on.new_zeros(n_units).scatter_add(0, unit, on)
    mean_U = log_ratio.new_zeros(n_units).scatter_add(0, unit, log_ratio * on)
    mean_U = mean_U / tokens_U.clamp(min=1.0)
    score = torch.exp(mean_U)[unit].reshape_as(weights)
    adv_B_T = batch.adv_B[:, None].expand_as(weights)
    surrogate, binding = _clipped_surrogate(score, adv_B_T, clip)
    pg_loss = (weights * surrogate).sum()
    # ∂L/∂log πθ(t) = W_u · (-A s_u [not binding]) / T_u, W_u = Σ_{t'∈u} w_t'.
    weight_U = weights.new_zeros(n_units).scatter_add(0, unit, weights.reshape(-1))
    per_token_U = weight_U / tokens_U.clamp(min=1.0)
    pg_coef = per_token_U[unit].reshape_as(weights) * (-adv_B_T * score.detach() * (~binding))
    return finish(f"normalized_ratio_clip[{granularity}]", inputs, batch, pg_loss, pg_coef,
                  binding)
