"""Generator/trainer log-prob consistency audit (docs/concepts.md, log-prob
consistency audit).

At a frozen checkpoint, the log-probs the generator recorded for the ids it sampled (its KV-cached
incremental path, ``raw_model_logprobs``) are compared with the trainer path's teacher-forced
recomputation over the same exact prefixes and ids (``trainer_path_logprobs``, the function the
``Trainer`` scores with: shared prompt prefixes by default). Per action token::

    δ_t = log π_generator(a_t|h_t) - log π_trainer(a_t|h_t)

Reported: the signed mean of δ, p95, p99 and max of |δ| (quantiles exact: linear interpolation
between order statistics, as ``torch.quantile``), the sequence log-perplexity difference, and
the non-negative k3 estimate of KL(π_gen || π_trainer) from generator samples,
k3 = E[exp(-δ) - 1 + δ]. The gate passes when max |δ| and p95 |δ| are within the declared
tolerances.

The audited distribution is the one that sampled: with an untruncated sampler at temperature τ
the generator's recorded ``behavior_logprobs`` (log softmax(z/τ)) are compared with the trainer
path at τ, exactly what the ``Trainer`` scores. With top-k/top-p truncation the trainer does not
reproduce the mask, so the raw log-probs (τ = 1) are compared instead. Pure TIM needs one
version on both sides: every episode must carry the audited manifest's weight checksum.

The tolerances are preregistered by ``consistency.tolerance_source`` (:func:`audit_tolerances`):
a fixed bound, or twice the log-prob change that bf16 rounding alone makes in the trainer engine
at the audited weights (the pure-bf16 same-engine baseline).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from closedloop.contracts import Episode, SamplerConfig
from closedloop.contracts.batch import TrainingBatch
from closedloop.engine import (
    drop_bf16_copies,
    matmul_precision,
    precision_label,
    trainer_path_logprobs,
)
from closedloop.errors import ContractError
from closedloop.rollout.tensors import ShiftedTargets, build_training_batch, shift_targets


@dataclass(frozen=True)
class AuditResult:
    """TIM statistics over the audited action tokens, and the gate verdict."""

    n_episodes: int
    n_tokens: int
    signed_mean: float
    abs_p95: float
    abs_p99: float
    abs_max: float
    k3: float
    log_ppl_diff: float
    tolerance_max: float
    tolerance_p95: float
    passed: bool
    weight_checksum: str
    trainer_dtype: str
    temperature: float = 1.0
    compared: str = "raw"  # "behavior" (the tempered sampler) or "raw" (temperature 1)

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return asdict(self)


def audit_logprobs(model: Any, episodes: Sequence[Episode], weight_checksum: str, *,
                   tolerance_max: float = 1e-3, tolerance_p95: float = 1e-4,
                   pad_id: int = 0, micro_batch_size: int = 4,
                   share_prompt_prefix: bool = True, precision: str = "float32",
                   sampler: SamplerConfig | None = None) -> AuditResult:
    """Compare recorded generator log-probs with the trainer path at the same weights.

    ``sampler`` (the episodes' sampler) selects what is compared (module doc); ``None`` compares
    the raw log-probs at temperature 1.

    ``precision`` is the trainer's matmul precision (``closedloop.engine.precision``); it is
    reported as ``trainer_dtype`` (``float32``, or ``bfloat16-matmul`` over float32 masters).
    """
    tempered = sampler is not None and sampler.top_k is None and sampler.top_p >= 1.0
    temperature = sampler.temperature if tempered and sampler is not None else 1.0
    usable = [ep for ep in episodes if ep.turns and all(
        (t.behavior_logprobs if tempered else t.raw_model_logprobs) is not None
        for t in ep.turns)]
    if not usable:
        raise ContractError("no episode with recorded generator log-probs to audit")
    for ep in usable:
        if ep.trajectory.behavior_weight_checksum != weight_checksum:
            raise ContractError(f"episode {ep.trajectory.episode_id} was sampled with other "
                                "weights: a same-version audit needs one checksum")
    recorded = torch.cat([
        (shifted.behavior_logprobs_B_T if tempered else shifted.raw_logprobs_B_T)[
            shifted.mask_B_T.bool()].double()
        for _, shifted in _micro_batches(usable, micro_batch_size, pad_id)])
    delta = recorded - _trainer_scores(model, usable, precision, temperature, pad_id,
                                       micro_batch_size, share_prompt_prefix)
    abs_delta = delta.abs()
    k3 = (torch.exp(-delta) - 1 + delta).mean()
    p95 = float(torch.quantile(abs_delta, 0.95))
    p99 = float(torch.quantile(abs_delta, 0.99))
    dtype = precision_label(precision, str(next(model.parameters()).dtype).removeprefix("torch."))
    return AuditResult(
        n_episodes=len(usable), n_tokens=int(delta.numel()), signed_mean=float(delta.mean()),
        abs_p95=p95, abs_p99=p99, abs_max=float(abs_delta.max()), k3=float(k3),
        log_ppl_diff=float(delta.mean()), tolerance_max=tolerance_max,
        tolerance_p95=tolerance_p95,
        passed=bool(float(abs_delta.max()) <= tolerance_max and p95 <= tolerance_p95),
        weight_checksum=weight_checksum, trainer_dtype=dtype, temperature=temperature,
        compared="behavior" if tempered else "raw")


def _micro_batches(episodes: Sequence[Episode], size: int, pad_id: int
                   ) -> Iterator[tuple[TrainingBatch, ShiftedTargets]]:
    for lo in range(0, len(episodes), size):
        batch = build_training_batch(episodes[lo:lo + size], pad_id=pad_id)
        yield batch, shift_targets(batch)


def _trainer_scores(model: Any, episodes: Sequence[Episode], precision: str, temperature: float,
                    pad_id: int, micro_batch_size: int, share_prompt_prefix: bool
                    ) -> torch.Tensor:
    """The trainer path's log-probs of every action token of ``episodes`` (float64, flat, in
    episode then token order), computed in eval mode without grad at ``precision``."""
    out = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), matmul_precision(model, precision):
            for batch, shifted in _micro_batches(episodes, micro_batch_size, pad_id):
                trainer = trainer_path_logprobs(model, batch.token_ids_B_T,
                                                batch.attention_mask_B_T, shifted.mask_B_T,
                                                share_prompt_prefix, temperature=temperature)
                out.append(trainer[shifted.mask_B_T.bool()].double())
    finally:
        model.train(was_training)
    return torch.cat(out)


TOLERANCE_SOURCES = ("bf16_same_engine_baseline", "fixed")


@dataclass(frozen=True)
class AuditTolerances:
    """The audit's bounds on max, p95 and p99 |δ|, where they came from, and the baseline
    measured (``None`` for the ``fixed`` source). ``tolerance_p99`` is not an audit criterion:
    it bounds the per-step p99 |log πθ/π_beh| of a bf16 run (gate ``ratio_on_policy``)."""

    tolerance_max: float
    tolerance_p95: float
    tolerance_p99: float
    tolerance_source: str
    baseline_abs_max: float | None = None
    baseline_abs_p95: float | None = None
    baseline_abs_p99: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return asdict(self)


def audit_tolerances(source: str, max_abs_tolerance: float, model: Any,
                     episodes: Sequence[Episode], *, pad_id: int = 0,
                     sampler: SamplerConfig | None = None, micro_batch_size: int = 4,
                     share_prompt_prefix: bool = True,
                     precision: str = "bfloat16") -> AuditTolerances:
    """The preregistered tolerances of an audit (config ``consistency.tolerance_source``).

    ``fixed``: max = τ, p95 = τ/10, p99 = τ, with τ = ``max_abs_tolerance``.

    ``bf16_same_engine_baseline``: the trainer path scores the audited tokens twice at the
    audited weights, with float32 and with bfloat16 matmuls: b_t = |log π_bf16(a_t) -
    log π_fp32(a_t)| is what bf16 rounding alone moves a log-prob in one engine, on this model
    and host. Generator and trainer each differ from the fp32 engine by at most one such
    rounding (none at float32), so by the triangle inequality their gap is bounded by 2·b:
    max = max(τ, 2·max_t b_t), p95 = max(τ/10, 2·p95_t b_t), p99 = max(τ, 2·p99_t b_t); τ stays a
    floor for a model on which bf16 happens to round exactly. (For a quantile the triangle
    inequality with a union bound guarantees 2·b_q only at level 2q - 1, e.g. p98 for p99: the
    quantile bounds are the declared convention, the max bound is the strict one.) The maximum
    grows with the number of tokens it is taken over, a quantile does not: p99 is the bound to
    compare with statistics over batches of another size. Audited tokens and temperature are
    those of :func:`audit_logprobs` with the same ``sampler``.

    ``precision`` is the run's matmul precision. A ``float32`` run has no bf16 rounding on either
    side (b = 0), so its bounds are the fixed ones: the baseline never loosens an fp32 audit.
    """
    if source == "fixed" or (source == "bf16_same_engine_baseline" and precision == "float32"):
        return AuditTolerances(max_abs_tolerance, max_abs_tolerance / 10, max_abs_tolerance,
                               source)
    if source != "bf16_same_engine_baseline":
        raise ContractError(f"tolerance source must be one of {TOLERANCE_SOURCES}, got {source!r}")
    tempered = sampler is not None and sampler.top_k is None and sampler.top_p >= 1.0
    temperature = sampler.temperature if tempered and sampler is not None else 1.0
    usable = [ep for ep in episodes if ep.turns]
    if not usable:
        raise ContractError("no episode to measure the bf16 same-engine baseline on")
    args = (temperature, pad_id, micro_batch_size, share_prompt_prefix)
    base = (_trainer_scores(model, usable, "bfloat16", *args)
            - _trainer_scores(model, usable, "float32", *args)).abs()
    drop_bf16_copies(model)  # the baseline's bf16 weight copies are not the run's to keep
    b_max, b_p95 = float(base.max()), float(torch.quantile(base, 0.95))
    b_p99 = float(torch.quantile(base, 0.99))
    return AuditTolerances(max(max_abs_tolerance, 2 * b_max),
                           max(max_abs_tolerance / 10, 2 * b_p95),
                           max(max_abs_tolerance, 2 * b_p99), source, b_max, b_p95, b_p99)


def sample_drift(model: Any, episodes: Sequence[Episode], *, pad_id: int, precision: str,
                 temperature: float, micro_batch_size: int = 4) -> float | None:
    """D_sample: the mean absolute log-prob gap over the action tokens the behaviour policy
    sampled, between the trainer's current weights and the recorded behaviour log-probs::

        D_sample = (1/|M|) Σ_{t∈M} |log π_train^u(a_t|h_t) - log π_beh^v(a_t|h_t)|

    A drift diagnostic of sampled actions (restricted to the action mask M), not a distance
    between policies; at u = v it is the generator/trainer mismatch alone. ``None`` when the
    episodes hold no action token. Scored without grad, in eval mode, at ``precision`` and the
    sampler's ``temperature`` (the distribution that sampled)."""
    if not episodes:
        return None
    trainer = _trainer_scores(model, episodes, precision, temperature, pad_id,
                              micro_batch_size, True)
    behaviour = torch.cat([shifted.behavior_logprobs_B_T[shifted.mask_B_T.bool()].double()
                           for _, shifted in _micro_batches(episodes, micro_batch_size, pad_id)])
    if behaviour.numel() == 0:
        return None
    return float((trainer - behaviour).abs().mean())
