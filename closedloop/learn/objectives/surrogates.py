"""Policy-update objectives with named outputs (seed 000 §6, seed 002 §11.4.3).

Three policies are kept apart: πθ (being updated, ``new_logprobs_B_T``, carries grad), π_beh
(sampled the tokens, ``behavior_logprobs_B_T``, the importance-ratio denominator) and π_ref
(``ref_logprobs_B_T``, only for KL; never an importance denominator). The PPO-style objectives
here cover the case π_prox = π_beh.

Shape letters: B episodes, T token positions. ``advantages_B`` holds one advantage per episode,
broadcast to its action tokens. ``mask_B_T`` is 1 on action tokens (aligned with the targets).
``turn_ids_B_T`` is the turn index of each action token (needed by turn reducers, turn-level
ratios and the turn clip fraction). Values of any input off the mask are ignored (NaN padding is
fine) and get zero gradient; on the mask every log-prob and advantage must be finite.

Every objective returns :class:`ObjectiveOutput`. Its gradient-mass fields use the per-token
coefficient c_it = ∂loss/∂log πθ(a_it), computed analytically (no backward): the mass of episode
i is m_i = Σ_t |c_it|. Shares of Σ_i m_i are reported for successful vs failed episodes and for
length bands by action-token count T_i: short T_i <= e0, medium e0 < T_i <= e1, long T_i > e1,
with (e0, e1) = ``length_band_edges`` (default (64, 256)).

``reducer`` names the loss reducer; ``weights_B_T`` optionally supplies its per-token weights
precomputed over a larger batch (gradient accumulation: pass the micro-batch's rows of the full
batch's weights, and the micro-batch losses sum to the full-batch loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from closedloop.learn.credit import LearnError
from closedloop.learn.kl import KLSpec, get_kl_estimator, validate_kl_placement
from closedloop.learn.reducers import MaskError, reducer_weights, turn_slot_ids

__all__ = [
    "NonFiniteLogprobError",
    "ObjectiveOutput",
    "normalized_ratio_clip",
    "ppo_clip",
    "reinforce_with_kl",
    "token_entropy",
]

Granularity = Literal["turn", "sequence"]


class NonFiniteLogprobError(LearnError):
    """A log-prob or advantage on an action token is missing or not finite."""


class ObjectiveOutput(NamedTuple):
    """Named outputs of an objective. Only ``loss`` carries grad; the rest are detached.

    ``pg_loss`` and ``kl`` are the reduced terms with ``loss = pg_loss + β·kl`` when KL is
    placed in the loss. ``kl`` is reduced with the objective's reducer; ``kl_token_mean`` is
    the plain mean over action tokens (comparable across reducers). Both are computed whenever
    ref log-probs are given, with the estimator of ``kl_spec``, else of ``reward_kl_spec``,
    else k3 (then they are monitoring only). ``grad_mass_total`` is Σ_it |c_it|; the other
    ``grad_mass_*`` fields are shares of it in [0, 1]. ``grad_coef_B_T`` holds c_it itself.
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
    **dict.fromkeys(
        ("ratio_p50", "ratio_p95", "ratio_p99", "ratio_max", "abs_log_ratio_mean",
         "abs_log_ratio_max"), "ratio"
    ),
    **dict.fromkeys(
        (
            "grad_mass_total",
            "grad_mass_success",
            "grad_mass_failure",
            "grad_mass_short",
            "grad_mass_medium",
            "grad_mass_long",
        ),
        "grad_mass",
    ),
    **dict.fromkeys(("n_episodes", "n_action_tokens", "n_empty_episodes"), "batch"),
}


@dataclass(frozen=True)
class _Batch:
    """Validated, sanitized inputs (zeros off the mask)."""

    new: torch.Tensor
    beh: torch.Tensor
    ref: torch.Tensor | None
    adv_B: torch.Tensor
    on: torch.Tensor
    turn_ids: torch.Tensor | None
    success_B: torch.Tensor | None
    entropy: torch.Tensor | None


def token_entropy(logits_B_T_V: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last dim: H = -Σ_v p_v log p_v, shape [B, T]."""
    logp = torch.log_softmax(logits_B_T_V, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


# ----------------------------------------------------------------------------- validation
def _on_mask(x: torch.Tensor, on: torch.Tensor, name: str) -> torch.Tensor:
    if x.shape != on.shape:
        raise MaskError(f"{name} shape {tuple(x.shape)} != mask shape {tuple(on.shape)}")
    if not bool(torch.isfinite(x[on]).all()):
        raise NonFiniteLogprobError(f"{name} is not finite on an action token")
    return torch.where(on, x, torch.zeros((), dtype=x.dtype))


def _check_per_episode(x: torch.Tensor | None, b: int, name: str) -> None:
    if x is not None and x.shape != (b,):
        raise MaskError(f"{name} must have shape [{b}], got {tuple(x.shape)}")


def _prepare(
    new: torch.Tensor,
    beh: torch.Tensor,
    ref: torch.Tensor | None,
    adv_B: torch.Tensor,
    mask: torch.Tensor,
    turn_ids: torch.Tensor | None,
    success_B: torch.Tensor | None,
    entropy: torch.Tensor | None,
) -> _Batch:
    if mask.dim() != 2:
        raise MaskError(f"mask_B_T must be 2-D [B, T], got shape {tuple(mask.shape)}")
    if not new.is_floating_point():
        raise LearnError(f"new_logprobs_B_T must be floating point, got {new.dtype}")
    on = mask > 0
    b = mask.shape[0]
    _check_per_episode(adv_B, b, "advantages_B")
    _check_per_episode(success_B, b, "success_B")
    if not bool(torch.isfinite(adv_B).all()):
        raise NonFiniteLogprobError("advantages_B holds a non-finite value")
    if turn_ids is not None:
        turn_slot_ids(mask, turn_ids)  # validates shape, dtype and sign
    return _Batch(
        new=_on_mask(new, on, "new_logprobs_B_T"),
        beh=_on_mask(beh.detach().to(new.dtype), on, "behavior_logprobs_B_T"),
        ref=None if ref is None else _on_mask(ref.detach().to(new.dtype), on, "ref_logprobs_B_T"),
        adv_B=adv_B.detach().to(new.dtype),
        on=on,
        turn_ids=turn_ids,
        success_B=success_B,
        entropy=None if entropy is None else _on_mask(entropy.detach(), on, "entropy_B_T"),
    )


def _weights(reducer: str, batch: _Batch, weights_B_T: torch.Tensor | None) -> torch.Tensor:
    """The reducer's per-token weights, or the caller's precomputed ones (validated).

    Pass ``weights_B_T`` to accumulate micro-batches: slice the rows of
    ``reducer_weights(reducer, full_mask, full_turn_ids)`` so every micro-batch uses the
    full batch's normalizers, and summing the micro-batch losses gives the full-batch loss.
    """
    if weights_B_T is None:
        return reducer_weights(reducer, batch.on, batch.turn_ids, dtype=batch.new.dtype)
    if weights_B_T.shape != batch.on.shape:
        raise MaskError(
            f"weights_B_T shape {tuple(weights_B_T.shape)} != mask shape {tuple(batch.on.shape)}"
        )
    if bool((weights_B_T[~batch.on] != 0).any()) or bool((weights_B_T < 0).any()):
        raise MaskError("weights_B_T must be >= 0 and exactly 0 off the mask")
    return weights_B_T.detach().to(batch.new.dtype)


# ----------------------------------------------------------------------------- KL
_KL_DERIVATIVE = {
    # d k / d log πθ, with d = log πref - log πθ
    "k1": lambda d: torch.ones_like(d),
    "k2": lambda d: -d,
    "k3": lambda d: -torch.expm1(d),
}


class _KLTerm(NamedTuple):
    value: torch.Tensor | None  # reduced KL with grad (None without ref log-probs)
    token_mean: float | None
    coef_B_T: torch.Tensor  # β · w · dk/dlogπθ when placed in the loss, else 0


def _kl_term(
    batch: _Batch, weights: torch.Tensor, spec: KLSpec | None, reward_spec: KLSpec | None
) -> _KLTerm:
    validate_kl_placement(spec, reward_spec)
    zeros = torch.zeros_like(weights)
    in_loss = spec is not None and spec.beta > 0
    if batch.ref is None:
        if in_loss:
            raise LearnError("kl_spec places KL in the loss but ref_logprobs_B_T is None")
        return _KLTerm(None, None, zeros)
    name = (spec or reward_spec or KLSpec()).estimator
    k = torch.where(batch.on, get_kl_estimator(name)(batch.new, batch.ref), 0.0)
    n_tok = int(batch.on.sum())
    token_mean = float(k.detach().sum() / n_tok) if n_tok else None
    if spec is None or spec.beta == 0:
        return _KLTerm((weights * k).sum(), token_mean, zeros)
    d = (batch.ref - batch.new).detach()
    coef = spec.beta * weights * _KL_DERIVATIVE[name](d)
    return _KLTerm((weights * k).sum(), token_mean, coef)


# ----------------------------------------------------------------------------- statistics
def _ratio_stats(batch: _Batch) -> dict[str, float | None]:
    log_ratio = (batch.new.detach() - batch.beh)[batch.on].double()
    if log_ratio.numel() == 0:
        return dict.fromkeys(
            ("ratio_p50", "ratio_p95", "ratio_p99", "ratio_max", "abs_log_ratio_mean",
             "abs_log_ratio_max")
        )
    ratio = log_ratio.exp()
    q = torch.quantile(ratio, ratio.new_tensor([0.5, 0.95, 0.99]))
    return {
        "ratio_p50": float(q[0]),
        "ratio_p95": float(q[1]),
        "ratio_p99": float(q[2]),
        "ratio_max": float(ratio.max()),
        "abs_log_ratio_mean": float(log_ratio.abs().mean()),
        "abs_log_ratio_max": float(log_ratio.abs().max()),
    }


def _clip_fractions(batch: _Batch, clipped_B_T: torch.Tensor) -> dict[str, float | None]:
    """Token: clipped action tokens / action tokens. Turn: turns (episode, turn id) with any
    clipped token / turns. Episode: episodes with any clipped token / non-empty episodes."""
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


def _grad_mass(
    batch: _Batch, coef_B_T: torch.Tensor, edges: tuple[int, int]
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


def _finish(
    objective: str,
    reducer: str,
    batch: _Batch,
    pg_loss: torch.Tensor,
    pg_coef_B_T: torch.Tensor,
    kl: _KLTerm,
    specs: tuple[KLSpec | None, KLSpec | None],
    clipped_B_T: torch.Tensor | None,
    edges: tuple[int, int],
) -> ObjectiveOutput:
    spec = specs[0]
    loss = pg_loss
    if spec is not None and spec.beta > 0 and kl.value is not None:
        loss = pg_loss + spec.beta * kl.value
    coef = (pg_coef_B_T + kl.coef_B_T) * batch.on
    n_tok = int(batch.on.sum())
    clips = (
        _clip_fractions(batch, clipped_B_T)
        if clipped_B_T is not None
        else dict.fromkeys(("clip_frac_token", "clip_frac_turn", "clip_frac_episode"))
    )
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
        **_ratio_stats(batch),
        grad_mass_total=float(coef.detach().abs().sum()),
        **_grad_mass(batch, coef.detach(), edges),
        grad_coef_B_T=coef.detach(),
        n_episodes=int(batch.on.shape[0]),
        n_action_tokens=n_tok,
        n_empty_episodes=int((~batch.on.any(dim=1)).sum()),
        objective=objective,
        reducer=reducer,
        kl_spec=spec,
        reward_kl_spec=specs[1],
    )


# ----------------------------------------------------------------------------- objectives
def reinforce_with_kl(
    *,
    new_logprobs_B_T: torch.Tensor,
    behavior_logprobs_B_T: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_B_T: torch.Tensor,
    turn_ids_B_T: torch.Tensor | None = None,
    success_B: torch.Tensor | None = None,
    ref_logprobs_B_T: torch.Tensor | None = None,
    entropy_B_T: torch.Tensor | None = None,
    reducer: str = "episode_sum",
    kl_spec: KLSpec | None = None,
    reward_kl_spec: KLSpec | None = None,
    length_band_edges: tuple[int, int] = (64, 256),
    weights_B_T: torch.Tensor | None = None,
) -> ObjectiveOutput:
    """REINFORCE (+ KL): L = R_w(-A_i · log πθ(a_it)) + β · R_w(k(a_it)).

    R_w is the named reducer (``Σ_{i,t} w_it ·``, see :mod:`closedloop.learn.reducers`). With
    ``reducer="episode_sum"`` the policy term is the seed's strict synchronous baseline
    L_pg = -(1/B) Σ_i A_i Σ_{t∈M_i} log πθ(a_it): the score-function estimate for expected
    episode return. Any other reducer is a different surrogate.

    Contract: this objective has no ratio and no clipping, so it is valid only when
    π_beh = π_prox = πθ at the start of the gradient step (one optimizer step per fresh batch,
    logprob consistency gate passed). ``behavior_logprobs_B_T`` is used only to report the
    ratio πθ/π_beh, which must be ≈ 1 on fresh data; large tails mean the contract is broken.
    KL enters the loss when ``kl_spec`` (placement "loss") has β > 0. Clip fractions are None.
    """
    batch = _prepare(
        new_logprobs_B_T,
        behavior_logprobs_B_T,
        ref_logprobs_B_T,
        advantages_B,
        mask_B_T,
        turn_ids_B_T,
        success_B,
        entropy_B_T,
    )
    weights = _weights(reducer, batch, weights_B_T)
    adv_B_T = batch.adv_B[:, None].expand_as(weights)
    pg_loss = (weights * (-adv_B_T * batch.new)).sum()
    kl = _kl_term(batch, weights, kl_spec, reward_kl_spec)
    return _finish(
        "reinforce_with_kl",
        reducer,
        batch,
        pg_loss,
        -weights * adv_B_T,
        kl,
        (kl_spec, reward_kl_spec),
        None,
        length_band_edges,
    )


def _clip_bounds(clip_eps: float, clip_eps_high: float | None) -> tuple[float, float]:
    high = clip_eps if clip_eps_high is None else clip_eps_high
    if not (0.0 < clip_eps < 1.0 and high > 0.0):
        raise LearnError(f"need 0 < clip_eps < 1 and clip_eps_high > 0, got {clip_eps}, {high}")
    return 1.0 - clip_eps, 1.0 + high


def _clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, lo: float, hi: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-element -min(ρA, clip(ρ, lo, hi)A) and where the clip binds (zeroes the gradient)."""
    surrogate = -torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)
    r = ratio.detach()
    binding = ((adv > 0) & (r > hi)) | ((adv < 0) & (r < lo))
    return surrogate, binding


def ppo_clip(
    *,
    new_logprobs_B_T: torch.Tensor,
    behavior_logprobs_B_T: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_B_T: torch.Tensor,
    turn_ids_B_T: torch.Tensor | None = None,
    success_B: torch.Tensor | None = None,
    ref_logprobs_B_T: torch.Tensor | None = None,
    entropy_B_T: torch.Tensor | None = None,
    reducer: str = "episode_sum",
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    kl_spec: KLSpec | None = None,
    reward_kl_spec: KLSpec | None = None,
    length_band_edges: tuple[int, int] = (64, 256),
    weights_B_T: torch.Tensor | None = None,
) -> ObjectiveOutput:
    """Token-level PPO clip: ℓ_it = -min(ρ_it A_i, clip(ρ_it, 1-ε, 1+ε_high) A_i), reduced by R_w.

    ρ_it = exp(log πθ(a_it) - log π_beh(a_it)) (π_prox = π_beh). ``clip_eps_high`` defaults to
    ``clip_eps``; a larger value is DAPO's asymmetric "clip-higher". At ρ = 1 the gradient equals
    REINFORCE's. A token is *clipped* when the clip binds, i.e. its gradient is zeroed:
    (A > 0 and ρ > 1+ε_high) or (A < 0 and ρ < 1-ε); A = 0 tokens are never clipped.
    clip_frac_token: clipped tokens / action tokens; clip_frac_turn: turns with any clipped token
    / turns (needs ``turn_ids_B_T``); clip_frac_episode: episodes with any clipped token /
    episodes with an action token. Clipping bounds the update on sampled actions only; it does
    not turn stale data into on-policy data.
    """
    lo, hi = _clip_bounds(clip_eps, clip_eps_high)
    batch = _prepare(
        new_logprobs_B_T,
        behavior_logprobs_B_T,
        ref_logprobs_B_T,
        advantages_B,
        mask_B_T,
        turn_ids_B_T,
        success_B,
        entropy_B_T,
    )
    weights = _weights(reducer, batch, weights_B_T)
    adv_B_T = batch.adv_B[:, None].expand_as(weights)
    ratio = torch.exp(batch.new - batch.beh)
    surrogate, binding = _clipped_surrogate(ratio, adv_B_T, lo, hi)
    pg_loss = (weights * surrogate).sum()
    pg_coef = -weights * adv_B_T * ratio.detach() * (~binding)
    kl = _kl_term(batch, weights, kl_spec, reward_kl_spec)
    return _finish(
        "ppo_clip",
        reducer,
        batch,
        pg_loss,
        pg_coef,
        kl,
        (kl_spec, reward_kl_spec),
        binding & batch.on,
        length_band_edges,
    )


def _unit_ids(batch: _Batch, granularity: Granularity) -> tuple[torch.Tensor, int]:
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


def normalized_ratio_clip(
    *,
    new_logprobs_B_T: torch.Tensor,
    behavior_logprobs_B_T: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_B_T: torch.Tensor,
    granularity: Granularity,
    clip_eps: float,
    clip_eps_high: float | None = None,
    turn_ids_B_T: torch.Tensor | None = None,
    success_B: torch.Tensor | None = None,
    ref_logprobs_B_T: torch.Tensor | None = None,
    entropy_B_T: torch.Tensor | None = None,
    reducer: str = "length_normalized",
    kl_spec: KLSpec | None = None,
    reward_kl_spec: KLSpec | None = None,
    length_band_edges: tuple[int, int] = (64, 256),
    weights_B_T: torch.Tensor | None = None,
) -> ObjectiveOutput:
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
    lo, hi = _clip_bounds(clip_eps, clip_eps_high)
    batch = _prepare(
        new_logprobs_B_T,
        behavior_logprobs_B_T,
        ref_logprobs_B_T,
        advantages_B,
        mask_B_T,
        turn_ids_B_T,
        success_B,
        entropy_B_T,
    )
    weights = _weights(reducer, batch, weights_B_T)
    unit, n_units = _unit_ids(batch, granularity)
    on = batch.on.reshape(-1).to(batch.new.dtype)
    log_ratio = (batch.new - batch.beh).reshape(-1)
    tokens_U = on.new_zeros(n_units).scatter_add(0, unit, on)
    mean_U = log_ratio.new_zeros(n_units).scatter_add(0, unit, log_ratio * on)
    mean_U = mean_U / tokens_U.clamp(min=1.0)
    score = torch.exp(mean_U)[unit].reshape_as(weights)
    adv_B_T = batch.adv_B[:, None].expand_as(weights)
    surrogate, binding = _clipped_surrogate(score, adv_B_T, lo, hi)
    pg_loss = (weights * surrogate).sum()
    # ∂L/∂log πθ(t) = W_u · (-A s_u [not binding]) / T_u, W_u = Σ_{t'∈u} w_t'.
    weight_U = weights.new_zeros(n_units).scatter_add(0, unit, weights.reshape(-1))
    per_token_U = weight_U / tokens_U.clamp(min=1.0)
    pg_coef = per_token_U[unit].reshape_as(weights) * (-adv_B_T * score.detach() * (~binding))
    kl = _kl_term(batch, weights, kl_spec, reward_kl_spec)
    return _finish(
        f"normalized_ratio_clip[{granularity}]",
        reducer,
        batch,
        pg_loss,
        pg_coef * batch.on,
        kl,
        (kl_spec, reward_kl_spec),
        binding & batch.on,
        length_band_edges,
    )
