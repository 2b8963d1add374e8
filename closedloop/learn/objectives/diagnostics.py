"""The terms every objective shares: the KL term, ratio tails, clip fractions, gradient mass,
and the assembly of :class:`~closedloop.contracts.update.ObjectiveOutput`.

KL: k = k_j(log πθ, log π_ref) per action token (:mod:`closedloop.learn.kl`), reduced with the
objective's weights w_it; placed in the loss as β·Σ w_it k_it when ``kl_spec.beta > 0``. Its
analytic coefficient is β·w_it·∂k/∂log πθ with d = log π_ref - log πθ: k1 → 1, k2 → -d,
k3 → -(e^d - 1).

Ratio tails (:func:`ratio_stats`): over the action tokens' log ρ_it = log πθ - log π_beh,
the p50, p95, p99 and max of ρ = exp(log ρ) and the mean, p99 and max of |log ρ|. Quantiles are
exact: linear interpolation between order statistics (``torch.quantile``). ``log_ratio_N`` in
the output keeps the detached per-token log ρ so that a caller holding several micro-batches
can compute the same statistics over all of them.

Clip fractions: token = clipped action tokens / action tokens; turn = turns (episode, turn id)
holding a clipped token / turns; episode = episodes holding one / non-empty episodes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from closedloop.contracts.batch import KLSpec
from closedloop.contracts.update import ObjectiveInputs, ObjectiveOutput
from closedloop.errors import LearnError
from closedloop.learn.kl import get_kl_estimator, validate_kl_placement
from closedloop.learn.objectives.inputs import PreparedBatch
from closedloop.learn.reducers import turn_slot_ids

__all__ = ["RATIO_KEYS", "KLTerm", "finish", "kl_term", "ratio_stats", "token_entropy"]

_KL_DERIVATIVE = {
    # d k / d log πθ, with d = log πref - log πθ
    "k1": lambda d: torch.ones_like(d),
    "k2": lambda d: -d,
    "k3": lambda d: -torch.expm1(d),
}
RATIO_KEYS = ("ratio_p50", "ratio_p95", "ratio_p99", "ratio_max", "abs_log_ratio_mean",
              "abs_log_ratio_p99", "abs_log_ratio_max")
_CLIP_KEYS = ("clip_frac_token", "clip_frac_turn", "clip_frac_episode")


def token_entropy(logits_B_T_V: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last dim: H = -Σ_v p_v log p_v, shape [B, T]."""
    logp = torch.log_softmax(logits_B_T_V, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


class KLTerm(NamedTuple):
    """The reduced KL (with grad; ``None`` without ref log-probs), its token mean, and its
    per-token gradient coefficient (zero unless KL is placed in the loss)."""

    value: torch.Tensor | None
    token_mean: float | None
    coef_B_T: torch.Tensor


def kl_term(batch: PreparedBatch, spec: KLSpec | None, reward_spec: KLSpec | None) -> KLTerm:
    """The KL term of the module doc; raises when ``spec`` needs ref log-probs that are absent."""
    validate_kl_placement(spec, reward_spec)
    weights = batch.weights
    zeros = torch.zeros_like(weights)
    in_loss = spec is not None and spec.beta > 0
    if batch.ref is None:
        if in_loss:
            raise LearnError("kl_spec places KL in the loss but ref_logprobs_B_T is None")
        return KLTerm(None, None, zeros)
    name = (spec or reward_spec or KLSpec()).estimator
    k = torch.where(batch.on, get_kl_estimator(name)(batch.new, batch.ref), 0.0)
    n_tok = int(batch.on.sum())
    token_mean = float(k.detach().sum() / n_tok) if n_tok else None
    if spec is None or spec.beta == 0:
        return KLTerm((weights * k).sum(), token_mean, zeros)
    d = (batch.ref - batch.new).detach()
    coef = spec.beta * weights * _KL_DERIVATIVE[name](d)
    return KLTerm((weights * k).sum(), token_mean, coef)


def ratio_stats(log_ratio_N: torch.Tensor) -> dict[str, float | None]:
    """The ratio tails of the module doc over the flat per-token log ρ ``log_ratio_N`` (every
    key ``None`` when it is empty): ρ quantiles p50/p95/p99 and max, |log ρ| mean, p99 and max.
    """
    log_ratio = log_ratio_N.detach().double()
    if log_ratio.numel() == 0:
        return dict.fromkeys(RATIO_KEYS)
    ratio = log_ratio.exp()
    q = torch.quantile(ratio, ratio.new_tensor([0.5, 0.95, 0.99]))
    abs_log = log_ratio.abs()
    return {
        "ratio_p50": float(q[0]),
        "ratio_p95": float(q[1]),
        "ratio_p99": float(q[2]),
        "ratio_max": float(ratio.max()),
        "abs_log_ratio_mean": float(abs_log.mean()),
        "abs_log_ratio_p99": float(torch.quantile(abs_log, 0.99)),
        "abs_log_ratio_max": float(abs_log.max()),
    }


def _clip_fractions(batch: PreparedBatch, clipped_B_T: torch.Tensor) -> dict[str, float | None]:
    on = batch.on
    clipped = clipped_B_T & on
    n_tok = int(on.sum())
    rows = on.any(dim=1)
    out: dict[str, float | None] = {
        "clip_frac_token": float(clipped.sum()) / n_tok if n_tok else None,
        "clip_frac_episode": (float(clipped.any(dim=1).sum()) / int(rows.sum()) if n_tok else None),
        "clip_frac_turn": None,
    }
    if batch.turn_ids is not None and n_tok:
        slot = turn_slot_ids(on, batch.turn_ids)
        n_slots = int(slot.max()) + 1
        shape = (on.shape[0], n_slots)
        has_turn = slot.new_zeros(shape).scatter_add_(1, slot, on.long()) > 0
        has_clip = slot.new_zeros(shape).scatter_add_(1, slot, clipped.long()) > 0
        out["clip_frac_turn"] = float(has_clip.sum()) / int(has_turn.sum())
    return out


def _grad_mass(batch: PreparedBatch, coef_B_T: torch.Tensor, edges: tuple[int, int]
               ) -> dict[str, float | None]:
    if not edges[0] <= edges[1]:
        raise LearnError(f"length_band_edges must be ascending, got {edges}")
    mass_B = coef_B_T.abs().sum(dim=1).double()
    total = float(mass_B.sum())
    lengths_B = batch.on.sum(dim=1)

    def share(select_B: torch.Tensor) -> float | None:
        return float(mass_B[select_B].sum()) / total if total > 0 else None

    out: dict[str, float | None] = {
        "grad_mass_short": share(lengths_B <= edges[0]),
        "grad_mass_medium": share((lengths_B > edges[0]) & (lengths_B <= edges[1])),
        "grad_mass_long": share(lengths_B > edges[1]),
        "grad_mass_success": None,
        "grad_mass_failure": None,
    }
    if batch.success_B is not None:
        ok = batch.success_B.bool()
        out["grad_mass_success"] = share(ok)
        out["grad_mass_failure"] = share(~ok)
    return out


def _clipped_mass(batch: PreparedBatch, clipped_B_T: torch.Tensor | None
                  ) -> dict[str, float | None]:
    """Σ |A_i| w_it ρ_it over the clipped action tokens, for A_i > 0 and for A_i < 0: the
    policy-gradient mass the clip removed, by advantage sign (``None`` without a clip). Whole
    batch weights make the sums of micro-batches the whole batch's."""
    if clipped_B_T is None:
        return {"grad_mass_clipped_pos": None, "grad_mass_clipped_neg": None}
    ratio = torch.exp((batch.new.detach() - batch.beh).double())
    mass_B_T = (batch.adv_B.double().abs()[:, None] * batch.weights.double().abs() * ratio
                * (clipped_B_T & batch.on))
    return {"grad_mass_clipped_pos": float(mass_B_T[batch.adv_B > 0].sum()),
            "grad_mass_clipped_neg": float(mass_B_T[batch.adv_B < 0].sum())}


def finish(objective: str, inputs: ObjectiveInputs, batch: PreparedBatch, pg_loss: torch.Tensor,
           pg_coef_B_T: torch.Tensor, clipped_B_T: torch.Tensor | None) -> ObjectiveOutput:
    """Add the KL term to the policy term and compute every diagnostic of the output.

    ``pg_coef_B_T`` is the policy term's analytic ∂pg_loss/∂log πθ; ``clipped_B_T`` marks the
    tokens whose gradient a clip zeroed (``None`` for an objective without clipping).
    """
    spec = inputs.kl_spec
    kl = kl_term(batch, spec, inputs.reward_kl_spec)
    loss = pg_loss
    if spec is not None and spec.beta > 0 and kl.value is not None:
        loss = pg_loss + spec.beta * kl.value
    coef = ((pg_coef_B_T + kl.coef_B_T) * batch.on).detach()
    log_ratio_N = (batch.new.detach() - batch.beh)[batch.on].double()
    n_tok = int(batch.on.sum())
    clips = (_clip_fractions(batch, clipped_B_T & batch.on) if clipped_B_T is not None
             else dict.fromkeys(_CLIP_KEYS))
    entropy = None
    if batch.entropy is not None and n_tok:
        entropy = float(batch.entropy.sum() / n_tok)
    return ObjectiveOutput(
        loss=loss,
        pg_loss=float(pg_loss.detach()),
        kl=None if kl.value is None else float(kl.value.detach()),
        kl_token_mean=kl.token_mean,
        entropy=entropy,
        **clips,
        **ratio_stats(log_ratio_N),
        grad_mass_total=float(coef.abs().sum()),
        **_grad_mass(batch, coef, inputs.length_band_edges),
        **_clipped_mass(batch, clipped_B_T),
        grad_coef_B_T=coef,
        log_ratio_N=log_ratio_N,
        n_episodes=int(batch.on.shape[0]),
        n_action_tokens=n_tok,
        n_empty_episodes=int((~batch.on.any(dim=1)).sum()),
        objective=objective,
        reducer=inputs.reducer,
        kl_spec=spec,
        reward_kl_spec=inputs.reward_kl_spec,
    )
