"""The segment store: partial rollouts paused at a declared boundary and resumed exactly
(partial rollouts and in-flight policy, docs/concepts.md).

An episode paused by ``Collector.rollout_segment`` (its turn budget spent) becomes a
:class:`Segment`: what continuing it needs, recorded, plus the live parts an in-process resume
uses (the environment, which ``resume`` restores to the recorded snapshot and checks, and the
episode's turns so far). A resume never reuses a KV cache: the generator prefills the exact
context ids again (under the same weights, or under new ones for a labelled mixed-policy
continuation), and the sampling stream continues from its recorded state, so a paused and
resumed episode samples what the uninterrupted one would.

Fields (one record per segment)::

    segment_id, continuation_parent    "<episode>#<k>", the segment it continues (None: first)
    snapshot_id                        the environment's snapshot at the pause
    context_token_ids                  the exact ids the next action continues
    memory_state_ref                   None: the exact-history memory policy keeps nothing else
    behavior_policy_version            the version that sampled this segment's actions
    behavior_logprobs                  those actions' behaviour log-probs, in order
    sampler_config                     the sampler of this segment
    remaining_step_budget              turns left before max_step_truncation
    remaining_token_budget             ids left in the context window
    termination_reason                 why the segment stopped ("paused")
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from closedloop.contracts import SamplerConfig, SnapshotRef, content_hash

__all__ = ["PausedEpisode", "Segment", "SegmentStore"]


@dataclass(frozen=True)
class Segment:
    """The record of one paused segment (module doc)."""

    segment_id: str
    episode_id: str
    continuation_parent: str | None
    snapshot_id: str
    context_token_ids: tuple[int, ...]
    memory_state_ref: str | None
    behavior_policy_version: str
    behavior_logprobs: tuple[float, ...]
    sampler_config: SamplerConfig
    remaining_step_budget: int
    remaining_token_budget: int
    termination_reason: str = "paused"

    def to_dict(self) -> dict[str, Any]:
        """JSON values (the context ids also as their content hash, for readers that skip
        them)."""
        return {"segment_id": self.segment_id, "episode_id": self.episode_id,
                "continuation_parent": self.continuation_parent,
                "snapshot_id": self.snapshot_id,
                "context_token_ids": list(self.context_token_ids),
                "context_hash": content_hash(list(self.context_token_ids)),
                "memory_state_ref": self.memory_state_ref,
                "behavior_policy_version": self.behavior_policy_version,
                "behavior_logprobs": list(self.behavior_logprobs),
                "sampler_config": asdict(self.sampler_config),
                "remaining_step_budget": self.remaining_step_budget,
                "remaining_token_budget": self.remaining_token_budget,
                "termination_reason": self.termination_reason}


@dataclass
class PausedEpisode:
    """A segment with what an in-process resume needs: the snapshot reference to restore, the
    sampling stream's state, and the collector's live episode (environment, turns so far)."""

    segment: Segment
    snapshot: SnapshotRef
    stream_state: Any
    live: Any = field(repr=False)


class SegmentStore:
    """Paused episodes waiting to resume, and the record of every segment paused (written to
    ``path`` as JSON lines when given). Thread-safe."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._paused: dict[str, PausedEpisode] = {}
        self.records: list[Segment] = []
        self._lock = threading.Lock()

    def pause(self, paused: PausedEpisode) -> None:
        """Keep a paused episode (one per episode at a time) and record its segment."""
        with self._lock:
            key = paused.segment.episode_id
            if key in self._paused:
                raise ValueError(f"episode {key} is paused already")
            self._paused[key] = paused
            self.records.append(paused.segment)
            if self.path is not None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.path, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps(paused.segment.to_dict(), sort_keys=True) + "\n")

    def take(self, episode_ids: list[str] | None = None) -> list[PausedEpisode]:
        """Remove and return the paused episodes (all, or those of ``episode_ids``), in the
        order they were paused."""
        with self._lock:
            keys = [k for k in self._paused if episode_ids is None or k in episode_ids]
            return [self._paused.pop(k) for k in keys]

    def waiting(self) -> list[str]:
        """Episode ids paused and not yet taken."""
        with self._lock:
            return list(self._paused)
