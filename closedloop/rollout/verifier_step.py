"""The verifier step: clean-room scoring as its own stage, after collection.

The generator (``closedloop.rollout.collector.Collector.rollout``) ends every episode with a
:class:`Rollout`: the turns it played, its termination, and for a terminal episode the
environment's exported final state (bytes). The environment is gone by then; the verifier step
sees only that exported state (never the agent, the live environment or the model), scores
each terminal episode with the task's verifier, and writes the episode's
``TrajectoryRecord`` with the reward vector (or the quarantine reason). Censored episodes
(truncation, timeout, infrastructure abort, cancellation) are not scored: their reward is
``None``, never 0.

    rollouts (generator)  ->  VerifierStep.score(groups)  ->  scored groups (admission)

A ``Rollout`` is immutable: scoring adds the verdict beside it, never changes what was sampled.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from closedloop.contracts import (
    Episode,
    GroupLease,
    PolicyManifest,
    TaskVerifier,
    Termination,
    TraceWriter,
    TrajectoryRecord,
    TurnRecord,
)

__all__ = ["CollectedGroup", "Rollout", "RolloutGroup", "VerifierStep", "score_groups"]


@dataclass(frozen=True)
class Rollout:
    """One finished, unscored episode as the generator wrote it.

    ``final_state``: the environment's exported state at the end (``export_state``), for
    terminal episodes only (``None`` for censored ones: nothing to score). ``mixed_policy``:
    the episode continued under another behaviour version than it started with (each turn
    records its own).
    """

    run_id: str
    episode_id: str
    lease: GroupLease
    sample_index: int
    task_family: str
    split: str
    env_version: str
    manifest: PolicyManifest
    turns: tuple[TurnRecord, ...]
    termination: Termination
    final_state: bytes | None
    final_state_hash: str
    started_at: str
    finished_at: str
    timings: dict[str, float] = field(default_factory=dict)
    mixed_policy: bool = False


@dataclass(frozen=True)
class RolloutGroup:
    """A lease and its G finished, unscored rollouts, in sample order."""

    lease: GroupLease
    rollouts: tuple[Rollout, ...]


@dataclass(frozen=True)
class CollectedGroup:
    """A lease and its G scored episodes, in sample order."""

    lease: GroupLease
    episodes: tuple[Episode, ...]


class VerifierStep:
    """Scores finished rollouts from their exported final state (see the module doc)."""

    def __init__(self, verifier: TaskVerifier, writer: TraceWriter | None = None) -> None:
        self.verifier = verifier
        self.writer = writer

    def score(self, groups: Sequence[RolloutGroup]) -> list[CollectedGroup]:
        """Score every rollout of every group, in order; write each trajectory record."""
        return [CollectedGroup(g.lease, tuple(self.score_one(r) for r in g.rollouts))
                for g in groups]

    def score_one(self, rollout: Rollout) -> Episode:
        """The episode of one rollout: the verifier's reward vector for a terminal episode
        (or its quarantine reason), ``None`` for a censored one."""
        timings = dict(rollout.timings)
        reward: dict[str, float] | None = None
        quarantine: str | None = None
        verifier_version: str | None = None
        if rollout.termination.is_terminal:
            t0 = time.perf_counter()
            result = self.verifier.score_or_quarantine(rollout.lease.task_id,
                                                       rollout.final_state or b"")
            reward, quarantine = result.reward, result.quarantine_reason
            verifier_version = self.verifier.verifier_version
            timings["verify_s"] = timings.get("verify_s", 0.0) + time.perf_counter() - t0
        lease, m = rollout.lease, rollout.manifest
        traj = TrajectoryRecord(
            run_id=rollout.run_id, episode_id=rollout.episode_id, group_id=lease.group_id,
            sample_index=rollout.sample_index, task_id=lease.task_id,
            task_family=rollout.task_family, split=rollout.split, seed=lease.seed,
            env_version=rollout.env_version, base_snapshot_id=lease.base_snapshot_id,
            behavior_policy_version=lease.behavior_policy_version,
            policy_manifest_hash=m.manifest_hash(), behavior_weight_checksum=m.weight_checksum,
            sampler_config=m.sampler, num_turns=len(rollout.turns),
            num_action_tokens=sum(len(t.action_token_ids) for t in rollout.turns),
            termination=rollout.termination, reward=reward, verifier_version=verifier_version,
            final_state_hash=rollout.final_state_hash or "none", quarantine_reason=quarantine,
            mixed_policy=rollout.mixed_policy, rollout_started_at=rollout.started_at,
            rollout_finished_at=rollout.finished_at, timings=timings)
        if self.writer is not None:
            self.writer.write(traj)
        return Episode(traj, rollout.turns)


def score_groups(groups: Sequence[RolloutGroup], verifier: TaskVerifier,
                 writer: TraceWriter | None = None) -> list[CollectedGroup]:
    """``VerifierStep(verifier, writer).score(groups)``."""
    return VerifierStep(verifier, writer).score(groups)
