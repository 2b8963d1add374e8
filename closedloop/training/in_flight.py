"""A round with a publication boundary inside it: what happens to an in-flight episode (partial
rollouts and in-flight policy, docs/concepts.md).

With ``rollout.partial_rollout_turns: k`` the generator plays the first k turns of round r under
its scheduled version v = v_max(0, r - L); the episodes still running are paused into the
segment store (``closedloop.rollout.segments``). That is the declared boundary at which
v' = v_max(0, r - L + 1), the version the trainer produced meanwhile, reaches the round; the
worker loads it only when ``rollout.in_flight_policy`` asks:

- ``finish_old``: the paused episodes resume under v (the version they started with); the
  round stays version-pinned.
- ``abort_and_restart``: every group with a paused member is discarded whole (its finished
  siblings too: a group never mixes versions) and played again from its base snapshot under
  v'; the aborted turns are counted, never trained on.
- ``mixed_policy``: the paused episodes continue under v' (a new session prefills their exact
  context under the new weights, no KV cache carried over); each turn records the version
  that sampled it and the episode is labelled ``mixed_policy`` (admitted only under this
  policy, outside the strict on-policy baseline).

The round's records are written once it ends (leases, each kept episode's turns, then the
verifier step's trajectories), so an aborted episode leaves nothing in the trace. What the
boundary did is kept beside the trace (``segments/step-NNNN.json``: the policy, the versions,
paused, aborted and mixed counts, every segment's record).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from closedloop.contracts import PolicyManifest, TraceWriter
from closedloop.policy.registry import version_name
from closedloop.rollout.segments import SegmentStore
from closedloop.rollout.verifier_step import Rollout, RolloutGroup
from closedloop.rollout.work_orders import WorkOrder
from closedloop.training.wiring import CollectorParts, make_collector

if TYPE_CHECKING:
    from closedloop.training.run import Run

__all__ = ["boundary_version", "in_flight_notes", "roll_with_boundary"]


def boundary_version(order: WorkOrder, max_version_lag: int) -> str:
    """v' = v_max(0, r - L + 1): the version that reaches round r at its boundary."""
    return version_name(max(0, order.round - max_version_lag + 1))


def notes_path(run: Run, round_index: int) -> Path:
    """``segments/step-NNNN.json`` of a round."""
    return run.dir / "segments" / f"step-{round_index:04d}.json"


def in_flight_notes(run: Run, round_index: int) -> dict[str, Any] | None:
    """What a round's boundary did (``None`` for a round without one)."""
    path = notes_path(run, round_index)
    if not path.is_file():
        return None
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))["in_flight"]
    return data


def roll_with_boundary(run: Run, order: WorkOrder, wait_for: Callable[[str], None]
                       ) -> Callable[[TraceWriter, Callable[[int], None]], list[RolloutGroup]]:
    """The generator's roll of a round with a boundary (module doc), for
    ``closedloop.training.collection.commit_trace``. ``wait_for(version)`` returns once the
    version is staged (under async the trainer may still be producing it)."""
    from closedloop.training.run import prove_and_acknowledge

    cfg = run.cfg.rollout
    worker = run.roles()[1]

    def collector(manifest: PolicyManifest) -> Any:
        prove_and_acknowledge(run, manifest.policy_version)
        p = worker.parts
        return make_collector(worker.source(manifest), manifest, CollectorParts(
            p.renderer, None, p.run_id, None, p.max_turns, p.package,
            sampling_salt=p.sampling_salt))

    def roll(writer: TraceWriter, progress: Callable[[int], None]) -> list[RolloutGroup]:
        store = SegmentStore()
        v = run.registry.manifest(order.behavior_version)
        first = collector(v)
        leases = [first.make_lease(s.group_id, s.task_id, s.seed, s.group_size)
                  for s in order.groups]
        finished = first.rollout_segment(leases, progress, turn_budget=cfg.partial_rollout_turns,
                                         store=store)
        paused = store.take()
        later = boundary_version(order, cfg.max_version_lag)
        notes: dict[str, Any] = {"policy": cfg.in_flight_policy, "version": v.policy_version,
                                 "boundary_version": later, "boundary_turns":
                                 cfg.partial_rollout_turns, "paused": len(paused),
                                 "aborted_groups": 0, "aborted_turns": 0, "mixed_episodes": 0}
        if paused and (cfg.in_flight_policy == "finish_old" or later == v.policy_version):
            finished.update(first.resume(paused, progress))
        elif paused:
            for p in paused:  # their kept sessions hold the old weights' caches
                first.source.close(p.live.key)
            wait_for(later)
            new = collector(run.registry.manifest(later))
            if cfg.in_flight_policy == "mixed_policy":
                rest = new.resume(paused, progress)
                notes["mixed_episodes"] = sum(r.mixed_policy for r in rest.values())
                finished.update(rest)
            else:
                leases = _restart(new, leases, finished, paused, notes, progress)
        groups = first.assemble(leases, finished)
        _write(writer, groups)
        _keep_notes(run, order.round, notes, store)
        return groups

    return roll


def _restart(new: Any, leases: list[Any], finished: dict[str, Rollout], paused: list[Any],
             notes: dict[str, Any], progress: Callable[[int], None]) -> list[Any]:
    """abort_and_restart: discard every group with a paused member, play it again from its
    base snapshot under the new collector's version; the leases with those groups replaced."""
    aborted = sorted({p.live.lease.group_id for p in paused})
    turns = sum(len(p.live.turns) for p in paused)
    for key in [k for k, r in finished.items() if r.lease.group_id in aborted]:
        turns += len(finished.pop(key).turns)
    redo = [new.make_lease(g.group_id, g.task_id, g.seed, g.group_size)
            for g in leases if g.group_id in aborted]
    finished.update(new.rollout_segment(redo, progress))
    notes.update(aborted_groups=len(aborted), aborted_turns=turns)
    by_id = {g.group_id: g for g in redo}
    return [by_id.get(g.group_id, g) for g in leases]


def _write(writer: TraceWriter, groups: list[RolloutGroup]) -> None:
    """Leases, then each kept episode's turns (the verifier step writes the trajectories)."""
    for g in groups:
        writer.write(g.lease)
    for g in groups:
        for r in g.rollouts:
            for t in r.turns:
                writer.write(t)


def _keep_notes(run: Run, round_index: int, notes: dict[str, Any],
                store: SegmentStore) -> None:
    path = notes_path(run, round_index)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"in_flight": notes,
                               "segments": [s.to_dict() for s in store.records]},
                              sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
