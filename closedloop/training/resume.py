"""Checkpoint and resume of a training run: the atomic trainer checkpoint written after every
RL step (and at step 0), and the resume that proves the run directory, restores the
checkpoint it names and reconciles the ledger with it."""

from __future__ import annotations

from closedloop.errors import (
    CheckpointError,
    LedgerInconsistencyError,
    RunNotReadyError,
    RunStateError,
)
from closedloop.learn.checkpoint import capture_rng_states, restore_rng_states, save_checkpoint
from closedloop.policy.lora import policy_weight_checksum
from closedloop.policy.registry import version_name
from closedloop.progress import log
from closedloop.rollout.task_sampler import DifficultyBandSampler
from closedloop.training.integrity import prove_state
from closedloop.training.run_policy import RunPolicy, adapter_state


class RunCheckpoints(RunPolicy):
    """The run's checkpoints and resume (a ``TrainingRun`` part)."""

    def save_credit_state(self, step: int) -> None:
        """Hook: state a credit estimator keeps beside checkpoint ``step`` (none here)."""

    def load_credit_state(self, step: int) -> None:
        """Hook: restore what ``save_credit_state`` kept for checkpoint ``step``."""

    def _checkpoint(self, step: int, version: str) -> None:
        if self.trainer is None:
            raise RunNotReadyError("no trainer")
        self.save_credit_state(step)  # before the checkpoint that names the step commits
        adapter = adapter_state(self.model)
        save_checkpoint(self.dir / "checkpoints", step, adapter,
                        self.trainer.optimizer.state_dict(), version, sorted(self.consumed),
                        capture_rng_states({"generator": self.generator.rng}),
                        {"sft_tokens": self.sft_tokens, "task_sampler": self.sampler.to_dict(),
                         "ledger_digest": self.ledger.digest().to_dict()})

    def resume(self) -> bool:
        """Prove the run directory's state (``closedloop.training.integrity.prove_state``), restore
        the checkpoint it names and reconcile the ledger with it. Without a checkpoint (a new
        run) write the step-0 one (the fresh adapter, optimizer and RNG states) and return
        False."""
        if self.trainer is None:
            raise RunNotReadyError("attach_rl_adapter() first")
        ckpt, _ = prove_state(self.dir, self.ledger, self.registry.versions(), self.metrics)
        if ckpt is None:
            self._checkpoint(0, version_name(0))
            return False
        missing = self.model.load_state_dict(ckpt.model_state, strict=False)
        if missing.unexpected_keys:
            raise CheckpointError(f"checkpoint holds unknown tensors: {missing.unexpected_keys}")
        self.trainer.optimizer.load_state_dict(ckpt.optimizer_state)
        self.load_credit_state(ckpt.step)
        restore_rng_states(ckpt.rng_states, {"generator": self.generator.rng}
                           if "generator" in ckpt.rng_states.get("generators", {}) else None)
        if "task_sampler" in ckpt.extra:
            self.sampler = DifficultyBandSampler.from_dict(ckpt.extra["task_sampler"])
        self.step = ckpt.step
        self.trainer.step_count = ckpt.step
        self.consumed = set(ckpt.consumed_group_ids)
        try:
            report = self.ledger.reconcile_with_checkpoint(self.consumed, ckpt.step,
                                                           ckpt.output_policy_version)
        except LedgerInconsistencyError as exc:
            raise RunStateError(self.ledger.path, f"disagrees with {ckpt.path} ({exc})",
                                "restore ledger.sqlite and checkpoints/ from one backup, or "
                                "start a new run directory") from None
        log(f"resumed at step {ckpt.step} ({ckpt.output_policy_version}); ledger: "
            f"{len(report.marked_consumed)} marked consumed from the checkpoint, "
            f"{len(report.reverted_to_admitted)} reverted to admitted")
        self.generator.refresh_weights(policy_weight_checksum(self.model).combined)
        active = self.registry.active()
        if active is None or active.version != ckpt.output_policy_version:
            self.publish(ckpt.output_policy_version)
        return True
