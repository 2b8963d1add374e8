"""The trainer: master weights (or LoRA adapters), optimizer state, one update per fresh batch.

``Trainer.step`` teacher-forces the recorded token ids (``closedloop.rollout.tensors``), scores
them under πθ (with grad) and π_ref (no grad), and applies the configured objective with the
configured reducer: never a framework default. Micro-batching is exact: the reducer's per-token
coefficients are computed once on the whole batch and each micro-batch is given its rows, so the
summed gradient equals the whole-batch gradient.

With ``share_prompt_prefix`` (default) both passes use ``shared_prefix_logprobs``: within each
micro-batch, rows whose ids agree up to their first action token (GRPO siblings) forward that
prompt once; the log-probs and the gradient equal ``sequence_logprobs``'s up to fp32 summation
order. Each micro-batch deduplicates its own rows, so a group split across micro-batches is
still exact (its prompt is then forwarded once per micro-batch).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from closedloop.learn.kl import KLSpec
from closedloop.learn.objectives import ObjectiveOutput, ppo_clip, reinforce_with_kl
from closedloop.learn.reducers import reducer_weights
from closedloop.policy.precision import check_precision, matmul_precision
from closedloop.policy.prefix_logprobs import trainer_path_logprobs
from closedloop.rollout.tensors import ShiftedTargets, TrainingBatch, shift_targets

Metrics = dict[str, float | int | None]


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
    precision: str = "float32"  # matmul precision (closedloop.policy.precision), as sampled
    # The sampler's temperature: πθ and π_ref are scored as softmax(logits / temperature), the
    # distribution that drew the tokens, so a fresh synchronous batch has ratio πθ/π_beh = 1.
    temperature: float = 1.0


@dataclass(frozen=True)
class StepResult:
    """Named outputs of one optimizer step."""

    metrics: Metrics
    grad_norm: float
    n_action_tokens: int
    n_tokens: int


def kl_spec_of(cfg: TrainerConfig) -> KLSpec | None:
    """The declared KL term: k-estimator, β, sampled under π_beh, placed in the loss."""
    if cfg.kl_beta <= 0:
        return None
    return KLSpec(estimator=cfg.kl_estimator, beta=cfg.kl_beta, sampling="behavior",
                  placement="loss")


class Trainer:
    """Holds the trainable policy, its reference, and the optimizer."""

    def __init__(self, model: torch.nn.Module, config: TrainerConfig,
                 reference: Callable[[], Any] | None = None) -> None:
        """``reference()`` returns a context manager under which ``model`` computes π_ref.

        For LoRA this disables the adapter (the reference is the base the adapter sits on);
        ``None`` means no reference and no KL term.
        """
        self.model = model
        self.config = config
        check_precision(config.precision)
        if not config.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {config.temperature}")
        self.reference = reference
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters")
        self.optimizer = torch.optim.AdamW(params, lr=config.learning_rate,
                                           weight_decay=config.weight_decay)
        self.step_count = 0

    def step(self, batch: TrainingBatch, advantages_B: torch.Tensor,
             success_B: torch.Tensor | None = None) -> StepResult:
        """One optimizer step on one fresh batch; returns the objective's named outputs."""
        metrics, n_act, n_tok = self.accumulate_gradients(batch, advantages_B, success_B)
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError("non-finite gradient norm: the step was not applied")
        self.optimizer.step()
        self.step_count += 1
        metrics["optim/grad_norm"] = grad_norm
        metrics["optim/lr"] = self.config.learning_rate
        return StepResult(metrics, grad_norm, n_act, n_tok)

    def accumulate_gradients(self, batch: TrainingBatch, advantages_B: torch.Tensor,
                             success_B: torch.Tensor | None = None
                             ) -> tuple[Metrics, int, int]:
        """Zero the gradients, then backpropagate the whole batch in micro-batches.

        Returns (merged metrics, action tokens, tokens). The gradient equals the whole-batch
        gradient whatever ``micro_batch_size`` is.
        """
        cfg = self.config
        shifted = shift_targets(batch)
        full_w = reducer_weights(cfg.reducer, shifted.mask_B_T, shifted.turn_ids_B_T)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        outputs: list[tuple[ObjectiveOutput, int]] = []
        with matmul_precision(self.model, cfg.precision):
            for rows in _chunks(batch.token_ids_B_T.shape[0], cfg.micro_batch_size):
                out = self._micro_step(batch, shifted, rows, advantages_B, success_B, full_w)
                outputs.append((out, len(rows)))
        n_act = int(shifted.mask_B_T.sum())
        return _merge_metrics(outputs), n_act, int(batch.attention_mask_B_T.sum())

    def _micro_step(self, batch: TrainingBatch, shifted: ShiftedTargets, rows: list[int],
                    advantages_B: torch.Tensor, success_B: torch.Tensor | None,
                    full_w: torch.Tensor) -> ObjectiveOutput:
        cfg = self.config
        idx = torch.tensor(rows)
        length = int(batch.attention_mask_B_T[idx].sum(dim=1).max())
        ids = batch.token_ids_B_T[idx, :length]
        attn = batch.attention_mask_B_T[idx, :length]
        mask = shifted.mask_B_T[idx, : length - 1]
        new = self._logprobs(ids, attn, mask)
        ref = None
        if self.reference is not None and cfg.kl_beta > 0:
            with torch.no_grad(), self.reference():
                ref = self._logprobs(ids, attn, mask)
        kwargs: dict[str, Any] = dict(
            new_logprobs_B_T=new,
            behavior_logprobs_B_T=shifted.behavior_logprobs_B_T[idx, : length - 1],
            advantages_B=advantages_B[idx], mask_B_T=mask,
            turn_ids_B_T=shifted.turn_ids_B_T[idx, : length - 1],
            success_B=None if success_B is None else success_B[idx],
            ref_logprobs_B_T=ref, reducer=cfg.reducer, kl_spec=kl_spec_of(cfg),
            weights_B_T=full_w[idx, : length - 1])
        if cfg.objective == "reinforce_with_kl":
            out = reinforce_with_kl(**kwargs)
        elif cfg.objective == "ppo_clip":
            out = ppo_clip(**kwargs, clip_eps=cfg.clip_eps)
        else:
            raise ValueError(f"unknown objective {cfg.objective!r}")
        out.loss.backward()
        return out

    def _logprobs(self, ids_B_T: torch.Tensor, attn_B_T: torch.Tensor,
                  mask_B_Tm1: torch.Tensor) -> torch.Tensor:
        """Log-probs ``[B, T-1]`` of the realized tokens at ``mask``, prompts shared or not."""
        return trainer_path_logprobs(self.model, ids_B_T, attn_B_T, mask_B_Tm1,
                                     self.config.share_prompt_prefix,
                                     temperature=self.config.temperature)


def _chunks(n: int, size: int) -> list[list[int]]:
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def _merge_metrics(outputs: list[tuple[ObjectiveOutput, int]]) -> Metrics:
    """Combine micro-batch metrics: sums for losses and counts, episode-weighted means else.

    Losses and gradient masses are sums over micro-batches (each already carries its share of
    the whole-batch normalization); maxima (``*_max``) are maxima; ratio quantiles, clip
    fractions and entropy are averaged.
    """
    merged: Metrics = {}
    per = [o.metrics() for o, _ in outputs]
    for key in per[0]:
        present = [(m[key], n) for m, (_, n) in zip(per, outputs, strict=True)
                   if m[key] is not None]
        if not present:
            merged[key] = None
        elif key.startswith(("batch/", "grad_mass/")) or key in ("losses/loss",
                                                                 "losses/pg_loss", "losses/kl"):
            merged[key] = sum(float(v) for v, _ in present)  # type: ignore[arg-type,misc]
        elif key.endswith("_max"):  # a tail bound must stay a bound across micro-batches
            merged[key] = max(float(v) for v, _ in present)  # type: ignore[arg-type,misc]
        else:
            merged[key] = (sum(float(v) * n for v, n in present)  # type: ignore[arg-type,misc]
                           / sum(n for _, n in present))
    merged["batch/micro_batches"] = len(outputs)
    return merged
