"""Checkpoint and resume of a training run: the atomic trainer checkpoint written after every
RL step (and at step 0), the commit that follows it (ledger, then publication), and the resume
that proves the run directory, restores the checkpoint it names and reconciles the ledger.

The trainer checkpoint is the commit point of a step (``closedloop.rollout.ledger``): weights,
optimizer, RNG states, the cumulative consumed group ids, the output version, the task
sampler and the work orders drawn for rounds not yet consumed commit together; only then does
the ledger mark the step's groups consumed and the publisher stage the output version.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from closedloop.errors import LedgerInconsistencyError, RunStateError
from closedloop.learn.checkpoint import capture_rng_states, restore_rng_states
from closedloop.policy.registry import PreparedWeights, prepare_weights, version_name
from closedloop.progress import log
from closedloop.rollout.task_sampler import DifficultyBandSampler
from closedloop.rollout.verifier_step import CollectedGroup
from closedloop.rollout.work_orders import WorkOrder
from closedloop.training.gae_step import load_critic, save_critic
from closedloop.training.integrity import prove_state
from closedloop.training.run import Run, publish

__all__ = ["checkpoint", "commit_step", "resume"]


def checkpoint(run: Run, step: int, version: str, *,
               adapter: Mapping[str, torch.Tensor] | None = None,
               prepared: PreparedWeights | None = None) -> None:
    """Commit trainer checkpoint ``step`` (output ``version``) atomically. ``adapter``: the
    trainer's adapter as already copied (``TrainerRole.adapter_state``; copied now if
    ``None``), ``prepared`` its bytes and checksum (``prepare_weights``)."""
    trainer, worker, _ = run.roles()
    state = run.state
    extra: dict[str, Any] = {"sft_tokens": state.sft_tokens,
                             "task_sampler": state.sampler.to_dict(),
                             "ledger_digest": run.ctx.ledger.digest().to_dict()}
    pending = [o.to_dict() for r, o in sorted(state.orders.items()) if r >= step]
    if pending:
        extra["work_orders"] = pending
    save_critic(run, step)  # the GAE critic beside this checkpoint, written before it commits
    trainer.checkpoint(run.dir / "checkpoints", step, version, sorted(state.consumed),
                       capture_rng_states({"generator": worker.rng}), extra, adapter=adapter,
                       prepared=prepared)


def commit_step(run: Run, step: int, admitted: Sequence[CollectedGroup], output: str, *,
                publish_inline: bool = True) -> None:
    """After step ``step``'s update: checkpoint ``step + 1`` (the commit point), mark the
    admitted groups consumed in the ledger, stage ``output``; with ``publish_inline`` the
    worker loads and acknowledges it at once (else at its next round boundary). The adapter
    is copied, serialized and hashed (as read back) once for the checkpoint and the stage,
    and the publisher's reference scores the probe on that copy (``ProbeReference.prime``)
    instead of reading the version back."""
    run.state.consumed.update(g.lease.group_id for g in admitted)
    trainer, _, publisher = run.roles()
    adapter = trainer.adapter_state()
    prepared = prepare_weights(adapter)
    checksum = trainer.checksum_with(prepared.checksum)
    checkpoint(run, step + 1, output, adapter=adapter, prepared=prepared)
    if admitted:
        run.ctx.ledger.mark_consumed([g.lease.group_id for g in admitted], step + 1, output)
    if publisher.reference is not None and publisher.probe is not None:
        publisher.reference.prime(checksum.combined, adapter, publisher.probe)
    if publish_inline:
        publish(run, output, adapter=prepared, checksum=checksum)
    else:
        publisher.stage(output, prepared, checksum)


def resume(run: Run) -> bool:
    """Prove the run directory's state (``closedloop.training.integrity.prove_state``), restore
    the checkpoint it names and reconcile the ledger with it; the worker then holds the
    checkpoint's version (published now if the registry's ACTIVE pointer is behind). Without a
    checkpoint (a new run) write the step-0 one (the fresh adapter, optimizer and RNG states)
    and return False."""
    trainer, worker, _ = run.roles()
    ctx, state = run.ctx, run.state
    ckpt, _ = prove_state(run.dir, ctx.ledger, ctx.registry.versions(), ctx.directory.metrics)
    if ckpt is None:
        checkpoint(run, 0, version_name(0))
        return False
    trainer.restore(ckpt)
    load_critic(run, ckpt.step)
    restore_rng_states(ckpt.rng_states, {"generator": worker.rng}
                       if "generator" in ckpt.rng_states.get("generators", {}) else None)
    if "task_sampler" in ckpt.extra:
        state.sampler = DifficultyBandSampler.from_dict(ckpt.extra["task_sampler"])
    state.orders = {o.round: o for o in (WorkOrder.from_dict(d)
                                         for d in ckpt.extra.get("work_orders", []))}
    state.step = ckpt.step
    state.consumed = set(ckpt.consumed_group_ids)
    try:
        report = ctx.ledger.reconcile_with_checkpoint(state.consumed, ckpt.step,
                                                      ckpt.output_policy_version)
    except LedgerInconsistencyError as exc:
        raise RunStateError(ctx.ledger.path, f"disagrees with {ckpt.path} ({exc})",
                            "restore ledger.sqlite and checkpoints/ from one backup, or "
                            "start a new run directory") from None
    log(f"resumed at step {ckpt.step} ({ckpt.output_policy_version}); ledger: "
        f"{len(report.marked_consumed)} marked consumed from the checkpoint, "
        f"{len(report.reverted_to_admitted)} reverted to admitted")
    active = ctx.registry.active()
    if active is None or active.version != ckpt.output_policy_version:
        publish(run, ckpt.output_policy_version)
    elif active.checksum != trainer.checksum().combined:
        raise RunStateError(ctx.registry.root / "ACTIVE", f"names {active.version} with "
                            f"weights other than {ckpt.path.name}'s", "restore registry/ and "
                            "checkpoints/ from one backup, or start a new run directory")
    else:
        worker.load(ckpt.output_policy_version)
    return True
