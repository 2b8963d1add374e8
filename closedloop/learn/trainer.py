"""The trainer: master weights (or LoRA adapters), optimizer state, the update of a fresh batch.

``Trainer.step`` teacher-forces the recorded token ids (``closedloop.rollout.tensors``), scores
them under πθ (with grad) and π_ref (no grad), and applies the objective the config names (a
registered name or a dotted path to a factory: ``closedloop.learn.objectives.get_objective``)
with the configured reducer: never a framework default. It takes one optimizer step per fresh
batch, or ``optimizer_steps_per_batch`` steps for an objective with ratios against π_beh (each
step re-scores πθ on the same tokens). Micro-batching is exact: the reducer's per-token
coefficients are computed once on the whole batch and each micro-batch is given its rows, so the
summed gradient equals the whole-batch gradient.

With ``share_prompt_prefix`` (default) both passes use ``shared_prefix_logprobs``: within each
micro-batch, rows whose ids agree up to their first action token (GRPO siblings) forward that
prompt once; the log-probs and the gradient equal ``sequence_logprobs``'s up to fp32 summation
order. Each micro-batch deduplicates its own rows, so a group split across micro-batches is
still exact (its prompt is then forwarded once per micro-batch).

``Trainer`` satisfies :class:`closedloop.contracts.update.PolicyUpdater`; its objective is any
:class:`closedloop.contracts.update.Objective`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from closedloop.contracts.batch import KLSpec, TrainingBatch
from closedloop.contracts.update import (
    Metrics,
    Objective,
    ObjectiveInputs,
    ObjectiveOutput,
    StepResult,
)
from closedloop.engine import check_precision, matmul_precision, trainer_path_logprobs
from closedloop.errors import BatchReuseError, LearnError
from closedloop.learn.objectives import ClipRange, get_objective, ratio_stats
from closedloop.learn.reducers import reducer_weights
from closedloop.rollout.tensors import ShiftedTargets, shift_targets


@dataclass(frozen=True)
class TrainerConfig:
    """Everything that shapes one optimizer step (recorded whole in the run)."""

    objective: str = "reinforce_with_kl"
    reducer: str = "episode_sum"
    learning_rate: float = 1e-4
    kl_beta: float = 0.02
    kl_estimator: str = "k3"
    clip_eps: float = 0.2
    max_grad_norm: float = 1.0
    micro_batch_size: int = 4
    weight_decay: float = 0.0
    share_prompt_prefix: bool = True  # forward each micro-batch's distinct prompts once (exact)
    precision: str = "float32"  # matmul precision (closedloop.engine.precision), as sampled
    # The sampler's temperature: πθ and π_ref are scored as softmax(logits / temperature), the
    # distribution that drew the tokens, so a fresh synchronous batch has ratio πθ/π_beh = 1.
    temperature: float = 1.0
    # Optimizer steps on each fresh batch (update.optimizer_steps_per_fresh_batch). More than one
    # needs an objective with ratios against π_beh (closedloop.learn.objectives.registry).
    optimizer_steps_per_batch: int = 1
    # π_prox: "behavior_policy" (π_prox = π_beh) or "trainer_at_step_start" (the decoupled
    # objective: π_prox = πθ as the step starts, scored by the first pass's own forward, no
    # extra pass; tokens weighed by π_prox/π_beh capped at behavior_weight_cap).
    proximal_policy: str = "behavior_policy"
    behavior_weight_cap: float = 5.0


def kl_spec_of(cfg: TrainerConfig) -> KLSpec | None:
    """The declared KL term: k-estimator, β, sampled under π_beh, placed in the loss."""
    if cfg.kl_beta <= 0:
        return None
    return KLSpec(estimator=cfg.kl_estimator, beta=cfg.kl_beta, sampling="behavior",
                  placement="loss")


class Trainer:
    """Holds the trainable policy, its reference, and the optimizer (a ``PolicyUpdater``)."""

    def __init__(self, model: torch.nn.Module, config: TrainerConfig,
                 reference: Callable[[], Any] | None = None,
                 reference_is_policy: Callable[[], bool] | None = None) -> None:
        """``reference()`` returns a context manager under which ``model`` computes π_ref.

        For LoRA this disables the adapter (the reference is the base the adapter sits on);
        ``None`` means no reference and no KL term. ``reference_is_policy()``, asked once per
        pass over a batch whose π_ref is not yet scored, says whether π_ref is πθ as it
        stands, bit for bit (a LoRA adapter that adds exactly nothing,
        ``closedloop.policy.lora.adapter_is_inert``: the first step of a run): π_ref's
        log-probs are then πθ's, detached, and its forward is not run.
        """
        self.model = model
        self.reference_is_policy = reference_is_policy
        self.config = config
        check_precision(config.precision)
        self.objective: Objective = get_objective(config.objective, ClipRange(config.clip_eps))
        if config.optimizer_steps_per_batch < 1:
            raise BatchReuseError("optimizer_steps_per_batch must be >= 1, got "
                                  f"{config.optimizer_steps_per_batch}")
        if config.optimizer_steps_per_batch > 1 and not self.objective.uses_ratio:
            raise BatchReuseError(f"{config.objective} has no ratio against π_beh: after one "
                                  "optimizer step its gradient is no longer the batch's; take "
                                  "one step per fresh batch or use a clipped-ratio objective")
        if not config.temperature > 0:
            raise LearnError(f"temperature must be > 0, got {config.temperature}")
        if config.proximal_policy not in ("behavior_policy", "trainer_at_step_start"):
            raise LearnError(f"proximal_policy must be behavior_policy or trainer_at_step_start,"
                             f" got {config.proximal_policy!r}")
        if config.proximal_policy != "behavior_policy" and not self.objective.uses_ratio:
            raise LearnError(f"{config.objective} has no ratio to take against π_prox")
        self.reference = reference
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise LearnError("the model has no trainable parameters")
        self.optimizer = torch.optim.AdamW(params, lr=config.learning_rate,
                                           weight_decay=config.weight_decay)
        self.step_count = 0

    def step(self, batch: TrainingBatch, advantages_B: torch.Tensor,
             success_B: torch.Tensor | None = None,
             token_advantages_B_T: torch.Tensor | None = None) -> StepResult:
        """``optimizer_steps_per_batch`` optimizer steps on one fresh batch.

        ``token_advantages_B_T`` (pre-shift, aligned with ``batch.token_ids_B_T``): per-token
        advantages (turn-level credit) that replace the broadcast of ``advantages_B``.

        Each pass re-scores πθ on the same tokens (so from the second pass on the ratio to the
        recorded π_beh moves away from 1), backpropagates, clips the gradient norm and steps;
        π_ref is scored once. A non-finite gradient norm zeroes the gradients and raises
        ``FloatingPointError``; that pass is not applied (earlier passes of the batch are).
        """
        passes: list[Metrics] = []
        norms: list[float] = []
        refs: dict[int, torch.Tensor] = {}
        proxs: dict[int, torch.Tensor] = {}
        n_act = n_tok = 0
        for _ in range(self.config.optimizer_steps_per_batch):
            metrics, n_act, n_tok = self._accumulate_gradients(batch, advantages_B, success_B,
                                                               token_advantages_B_T, refs,
                                                               proxs)
            params = [p for p in self.model.parameters() if p.requires_grad]
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm))
            if not math.isfinite(grad_norm):
                self.optimizer.zero_grad(set_to_none=True)
                raise FloatingPointError("non-finite gradient norm: the step was not applied")
            self.optimizer.step()
            metrics["optim/grad_norm"] = grad_norm
            passes.append(metrics)
            norms.append(grad_norm)
        self.step_count += 1
        first = dict(passes[0])
        first["optim/lr"] = self.config.learning_rate
        first["optim/steps_on_batch"] = len(passes)
        first["credit/adv_len_corr"] = advantage_length_correlation(
            advantages_B, shift_targets(batch).mask_B_T.sum(dim=1))
        if len(passes) > 1:
            first.update(pass_tails(passes))
        return StepResult(first, norms[0], n_act, n_tok, tuple(passes))

    def loss_and_gradient(self, batch: TrainingBatch, advantages_B: torch.Tensor,
                          success_B: torch.Tensor | None = None) -> tuple[float, torch.Tensor]:
        """The loss of one batch and the flat gradient of the trainable parameters, without a
        step (the gradients are zeroed again): what a step's first pass would apply."""
        metrics, _, _ = self._accumulate_gradients(batch, advantages_B, success_B)
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                          for p in params]).detach().clone()
        self.optimizer.zero_grad(set_to_none=True)
        return float(metrics["losses/loss"] or 0.0), grad

    def _accumulate_gradients(self, batch: TrainingBatch, advantages_B: torch.Tensor,
                              success_B: torch.Tensor | None = None,
                              token_advantages_B_T: torch.Tensor | None = None,
                              ref_cache: dict[int, torch.Tensor] | None = None,
                              prox_cache: dict[int, torch.Tensor] | None = None
                              ) -> tuple[Metrics, int, int]:
        """Zero the gradients, then backpropagate the whole batch in micro-batches.

        Returns (merged metrics, action tokens, tokens). The gradient equals the whole-batch
        gradient whatever ``micro_batch_size`` is. ``ref_cache`` (keyed by a micro-batch's first
        row) keeps π_ref's log-probs across passes over the same batch; ``prox_cache`` keeps
        π_prox's (the decoupled objective: πθ as first scored, before any step).
        """
        cfg = self.config
        shifted = shift_targets(batch)
        token_adv = None
        if token_advantages_B_T is not None:
            if token_advantages_B_T.shape != batch.token_ids_B_T.shape:
                raise LearnError(f"token_advantages_B_T shape {tuple(token_advantages_B_T.shape)}"
                                 f" != batch shape {tuple(batch.token_ids_B_T.shape)}")
            token_adv = token_advantages_B_T[:, 1:]
        full_w = reducer_weights(cfg.reducer, shifted.mask_B_T, shifted.turn_ids_B_T)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        outputs: list[tuple[ObjectiveOutput, int]] = []
        ref_cache = {} if ref_cache is None else ref_cache
        ref_is_policy = (not ref_cache and cfg.kl_beta > 0 and self.reference is not None
                         and self.reference_is_policy is not None and self.reference_is_policy())
        with matmul_precision(self.model, cfg.precision):
            for rows in _chunks(batch.token_ids_B_T.shape[0], cfg.micro_batch_size):
                out = self._micro_step(batch, shifted, rows, (advantages_B, token_adv),
                                       success_B, full_w, ref_cache,
                                       {} if prox_cache is None else prox_cache, ref_is_policy)
                outputs.append((out, len(rows)))
        n_act = int(shifted.mask_B_T.sum())
        return _merge_metrics(outputs), n_act, int(batch.attention_mask_B_T.sum())

    def _micro_step(self, batch: TrainingBatch, shifted: ShiftedTargets, rows: list[int],
                    advantages: tuple[torch.Tensor, torch.Tensor | None],
                    success_B: torch.Tensor | None,
                    full_w: torch.Tensor, ref_cache: dict[int, torch.Tensor],
                    prox_cache: dict[int, torch.Tensor],
                    ref_is_policy: bool = False) -> ObjectiveOutput:
        cfg = self.config
        advantages_B, token_adv = advantages
        idx = torch.tensor(rows)
        length = int(batch.attention_mask_B_T[idx].sum(dim=1).max())
        ids = batch.token_ids_B_T[idx, :length]
        attn = batch.attention_mask_B_T[idx, :length]
        mask = shifted.mask_B_T[idx, : length - 1]
        new = self._logprobs(ids, attn, mask)
        ref = ref_cache.get(rows[0])
        if ref is None and self.reference is not None and cfg.kl_beta > 0:
            if ref_is_policy:
                ref = ref_cache[rows[0]] = new.detach()
            else:
                with torch.no_grad(), self.reference():
                    ref = ref_cache[rows[0]] = self._logprobs(ids, attn, mask)
        prox = None
        if cfg.proximal_policy == "trainer_at_step_start":
            prox = prox_cache.setdefault(rows[0], new.detach())
        out = self.objective(ObjectiveInputs(
            new_logprobs_B_T=new,
            behavior_logprobs_B_T=shifted.behavior_logprobs_B_T[idx, : length - 1],
            advantages_B=advantages_B[idx], mask_B_T=mask,
            turn_ids_B_T=shifted.turn_ids_B_T[idx, : length - 1],
            success_B=None if success_B is None else success_B[idx],
            ref_logprobs_B_T=ref, reducer=cfg.reducer, kl_spec=kl_spec_of(cfg),
            weights_B_T=full_w[idx, : length - 1], proximal_logprobs_B_T=prox,
            behavior_weight_cap=cfg.behavior_weight_cap if prox is not None else None,
            token_advantages_B_T=None if token_adv is None else token_adv[idx, : length - 1]))
        out.loss.backward()
        return out

    def _logprobs(self, ids_B_T: torch.Tensor, attn_B_T: torch.Tensor,
                  mask_B_Tm1: torch.Tensor) -> torch.Tensor:
        """Log-probs ``[B, T-1]`` of the realized tokens at ``mask``, prompts shared or not."""
        return trainer_path_logprobs(self.model, ids_B_T, attn_B_T, mask_B_Tm1,
                                     self.config.share_prompt_prefix,
                                     temperature=self.config.temperature)


PASS_KEYS = ("ratio/abs_log_ratio_p99", "ratio/abs_log_ratio_max", "ratio/ratio_p99",
             "ratio/ratio_max", "clip/clip_frac_token", "clip/clip_frac_turn",
             "clip/clip_frac_episode", "grad_mass/grad_mass_clipped_pos",
             "grad_mass/grad_mass_clipped_neg", "optim/grad_norm")
"""The figures of each optimizer pass over a reused batch (``pass<k>/<key>``, k from 0): the
ratio tails, the clip fractions per granularity and the clipped mass by advantage sign, which
from the second pass on are no longer those of a fresh batch."""


def pass_tails(passes: tuple[Metrics, ...] | list[Metrics]) -> Metrics:
    """``pass<k>/<key>`` for every pass k and every key of ``PASS_KEYS`` a pass reported."""
    return {f"pass{k}/{key}": m[key] for k, m in enumerate(passes) for key in PASS_KEYS
            if key in m}


def advantage_length_correlation(advantages_B: torch.Tensor,
                                 lengths_B: torch.Tensor) -> float | None:
    """Pearson correlation of the episodes' advantages with their action-token counts (``None``
    with fewer than two episodes or a constant either side): a length bias of the credit, e.g.
    a reward that favours shorter episodes, or a null that is not one."""
    a, n = advantages_B.double(), lengths_B.double()
    if a.numel() < 2 or float(a.std()) == 0.0 or float(n.std()) == 0.0:
        return None
    return float(torch.corrcoef(torch.stack([a, n]))[0, 1])


def _chunks(n: int, size: int) -> list[list[int]]:
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def _merge_metrics(outputs: list[tuple[ObjectiveOutput, int]]) -> Metrics:
    """Combine micro-batch metrics: sums for losses and counts, episode-weighted means else.

    Losses and gradient masses are sums over micro-batches (each already carries its share of
    the whole-batch normalization); maxima (``*_max``) are maxima; clip fractions and entropy
    are averaged. The ratio tails (``ratio/*``) are recomputed over the action tokens of all
    micro-batches at once (``ratio_stats`` of their ``log_ratio_N``), so their quantiles are the
    whole batch's, exactly.
    """
    merged: Metrics = {}
    per = [o.metrics() for o, _ in outputs]
    whole = ratio_stats(torch.cat([o.log_ratio_N for o, _ in outputs]))
    for key in per[0]:
        if key.startswith("ratio/"):
            merged[key] = whole[key.removeprefix("ratio/")]
            continue
        present = [(m[key], n) for m, (_, n) in zip(per, outputs, strict=True)
                   if m[key] is not None]
        if not present:
            merged[key] = None
        elif key.startswith(("batch/", "grad_mass/")) or key in ("losses/loss",
                                                                 "losses/pg_loss", "losses/kl"):
            merged[key] = sum(float(v) for v, _ in present)  # type: ignore[arg-type,misc]
        elif key.endswith("_max"):  # a tail bound must stay a bound across micro-batches
            merged[key] = max(float(v) for v, _ in present)  # type: ignore[arg-type]
        else:
            merged[key] = (sum(float(v) * n for v, n in present)  # type: ignore[arg-type,misc]
                           / sum(n for _, n in present))
    merged["batch/micro_batches"] = len(outputs)
    return merged
