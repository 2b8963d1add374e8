"""Collecting a set of groups into one trace file: the generator's rollout, then the verifier
step, as two stages, then the trace committed (``.partial`` renamed into place).

The trace is written to ``<name>.partial`` while it grows (lease and turn records as the
generator plays, trajectory records as the verifier step scores) and renamed to
``<name>.jsonl`` only when complete, so a killed launch leaves a partial file a resume
discards and collects again with the same seeds and weights.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from closedloop.contracts import PolicyManifest, TraceWriter
from closedloop.progress import Progress
from closedloop.rollout.source import ActionSource
from closedloop.rollout.verifier_step import CollectedGroup, RolloutGroup, VerifierStep
from closedloop.rollout.work_orders import GroupSpec
from closedloop.training.wiring import CollectorParts, make_collector

if TYPE_CHECKING:
    from closedloop.training.run import Run

__all__ = ["collect_to_trace", "collect_with_worker", "commit_trace"]


Roll = Callable[[TraceWriter, Callable[[int], None]], list[RolloutGroup]]
"""``(writer, progress) -> rollouts``: a generator's rollout of some groups."""


def commit_trace(run: Run, path: Path, episodes: int, desc: str, roll: Roll
                 ) -> list[CollectedGroup]:
    """Run the generator's ``roll``, then the run's verifier step on what it returned, into
    ``path`` (module doc); the scored groups in order."""
    partial = path.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    with TraceWriter(partial) as writer:
        with Progress(episodes, desc) as bar:
            rollouts = roll(writer, bar.update)
        groups = VerifierStep(run.ctx.verifier, writer).score(rollouts)
    os.replace(partial, path)
    return groups


def collect_to_trace(run: Run, source: ActionSource, manifest: PolicyManifest, path: Path,
                     specs: Sequence[GroupSpec], desc: str) -> list[CollectedGroup]:
    """Roll out ``specs`` with ``source`` under ``manifest``, score them with the run's
    verifier step, and commit the trace ``path``; the scored groups in spec order."""
    ctx = run.ctx

    def roll(writer: TraceWriter, progress: Callable[[int], None]) -> list[RolloutGroup]:
        collector = make_collector(source, manifest, CollectorParts(
            run.policy.renderer, ctx.verifier, ctx.directory.run_id, writer,
            run.cfg.environment.max_turns, ctx.package, sampling_salt=run.cfg.training.seed))
        leases = [collector.make_lease(s.group_id, s.task_id, s.seed, s.group_size)
                  for s in specs]
        return collector.rollout(leases, progress=progress)

    return commit_trace(run, path, sum(s.group_size for s in specs), desc, roll)


def collect_with_worker(run: Run, manifest: PolicyManifest, path: Path,
                        specs: Sequence[GroupSpec], desc: str) -> list[CollectedGroup]:
    """The generator worker's rollout of ``specs`` under ``manifest``'s version (loaded from
    the registry first if the worker holds another), the verifier step, the trace committed."""
    worker = run.roles()[1]
    worker.load(manifest.policy_version)
    return commit_trace(run, path, sum(s.group_size for s in specs), desc,
                        lambda writer, progress: worker.rollout(manifest, specs, writer,
                                                                progress))
