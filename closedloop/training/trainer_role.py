"""The trainer role: π_train^u (the LoRA-adapted policy), its optimizer, one update per batch and
the atomic checkpoint.

The trainer never samples: its weights reach generators only through a published version
(``closedloop.training.publisher``). Its update is ``closedloop.learn.trainer.Trainer.step``
(credit → loss → one optimizer step, or the configured number on a batch an objective with
ratios may reuse); ``checkpoint`` commits the weights, optimizer, RNG states, the consumed
group ids and the output version together (``closedloop.learn.checkpoint``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from closedloop.config import RunConfig
from closedloop.contracts.update import StepResult
from closedloop.errors import CheckpointError
from closedloop.learn.checkpoint import Checkpoint, save_checkpoint
from closedloop.learn.trainer import Trainer, TrainerConfig
from closedloop.learn.turn_credit import broadcast_turn_values, turn_table
from closedloop.policy import attach_lora
from closedloop.policy.lora import (
    PolicyChecksum,
    PolicyChecksummer,
    adapter_is_inert,
    split_state_dict,
)
from closedloop.policy.registry import PreparedWeights
from closedloop.rollout.tensors import build_training_batch

__all__ = ["TrainerRole", "adapter_state", "trainer_config"]


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """A detached copy of the LoRA tensors: exactly those ``adapter_checksum`` covers."""
    return {k: v.detach().clone() for k, v in split_state_dict(model)[1].items()}


def trainer_config(cfg: RunConfig, precision: str) -> TrainerConfig:
    """The trainer's config from the run config (recorded whole as ``trainer.json``)."""
    t, u = cfg.training, cfg.update
    return TrainerConfig(objective=u.objective, reducer=cfg.credit.reduction,
                         learning_rate=t.learning_rate, kl_beta=u.kl_beta,
                         kl_estimator=u.kl_estimator, clip_eps=u.clip_eps,
                         precision=precision, temperature=cfg.rollout.temperature,
                         optimizer_steps_per_batch=u.optimizer_steps_per_fresh_batch,
                         proximal_policy=u.proximal_policy,
                         behavior_weight_cap=u.behavior_weight_cap)


class TrainerRole:
    """π_train^u and its optimizer: a fresh LoRA adapter on ``base_model`` (seeded by
    ``training.seed + 1``), π_ref = the base with the adapter disabled."""

    def __init__(self, base_model: Any, cfg: RunConfig, precision: str) -> None:
        t = cfg.training
        self.model = attach_lora(base_model, r=t.lora_rank, alpha=t.lora_alpha,
                                 seed=t.seed + 1, target_modules=tuple(t.lora_targets))
        self.config = trainer_config(cfg, precision)
        self.trainer = Trainer(self.model, self.config, reference=self.model.disable_adapter,
                               reference_is_policy=lambda: adapter_is_inert(self.model))
        self._checksum = PolicyChecksummer(self.model)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer (AdamW over the adapter)."""
        return self.trainer.optimizer

    def checksum(self) -> PolicyChecksum:
        """Base, adapter and combined checksums of π_train as it is now."""
        return self._checksum()

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """A detached copy of the adapter (what a version stages)."""
        return {k: v.clone() for k, v in self._checksum.split()[1].items()}

    def update(self, episodes: Sequence[Any], advantages: Sequence[float],
               success: Sequence[bool], pad_id: int,
               turn_advantages: Sequence[Sequence[float]] | None = None) -> StepResult:
        """Teacher-force the episodes' recorded ids and take the configured optimizer step(s)
        on them (``Trainer.step``). ``turn_advantages`` (one per recorded turn of each
        episode): each turn's advantage on its own action tokens, in place of the episode's."""
        batch = build_training_batch(list(episodes), pad_id=pad_id)
        token_adv = None
        if turn_advantages is not None:
            token_adv = broadcast_turn_values(turn_table(turn_advantages), batch.turn_ids_B_T,
                                              batch.action_mask_B_T)
        return self.trainer.step(batch, torch.tensor(list(advantages)),
                                 torch.tensor(list(success)), token_advantages_B_T=token_adv)

    def gradient(self, episodes: Sequence[Any], advantages: Sequence[float],
                 success: Sequence[bool], pad_id: int) -> tuple[float, torch.Tensor]:
        """The loss and the flat gradient of the adapter on a batch, without a step (the
        gradients are zeroed again)."""
        batch = build_training_batch(list(episodes), pad_id=pad_id)
        return self.trainer.loss_and_gradient(batch, torch.tensor(list(advantages)),
                                              torch.tensor(list(success)))

    def checkpoint(self, directory: Any, step: int, version: str, consumed: Sequence[str],
                   rng_states: Mapping[str, Any], extra: Mapping[str, Any], *,
                   adapter: Mapping[str, torch.Tensor] | None = None,
                   prepared: PreparedWeights | None = None) -> None:
        """Commit checkpoint ``step`` (adapter, optimizer, RNG states, consumed group ids,
        output version, ``extra``) atomically. ``adapter``: ``adapter_state()`` as already
        copied (copied now when ``None``); ``prepared``: its bytes and checksum when already
        serialized (``prepare_weights(adapter)``), written as they are."""
        if adapter is None:
            adapter, prepared = self.adapter_state(), None
        save_checkpoint(directory, step, adapter, self.optimizer.state_dict(), version,
                        sorted(consumed), rng_states, extra,
                        model_checksum=prepared.checksum if prepared else None,
                        model_bytes=prepared.payload if prepared else None)

    def checksum_with(self, adapter_checksum: str) -> PolicyChecksum:
        """``checksum()`` given the adapter's checksum, already taken from a copy of the
        adapter as it is now (``prepare_weights``): only the base's part is looked up."""
        return self._checksum.with_adapter(adapter_checksum)

    def restore(self, ckpt: Checkpoint) -> None:
        """Load a checkpoint's adapter and optimizer state; the step count follows it."""
        missing = self.model.load_state_dict(ckpt.model_state, strict=False)
        if missing.unexpected_keys:
            raise CheckpointError(f"checkpoint holds unknown tensors: {missing.unexpected_keys}")
        self.optimizer.load_state_dict(ckpt.optimizer_state)
        self.trainer.step_count = ckpt.step
