"""The environment contract (seed 000 §2): ``AgentEnv``.

An environment resets exactly, executes typed actions, exports its authoritative state as bytes,
and snapshots, restores and forks. It never scores itself: the verifier reads ``export_state()``.

Model text that does not parse as an action consumes one step and returns an error observation
(``Transition.error`` set); its effect on the state must not depend on the text (two different
unparsable texts from one state lead to one state). ``step`` never raises for anything a model
can write.

``SealingEnv`` adds the sealing contract: when an episode ends, its terminal state is sealed,
exported for the verifier by ``export_sealed`` and never restorable or forkable into an
agent-facing environment (``SealedSnapshotError``), nor steppable (``EpisodeDoneError``). An
environment without it cannot seal; the seal gate says so by name.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from closedloop.contracts import Action, SnapshotRef, Transition


@runtime_checkable
class AgentEnv(Protocol):
    """A resettable, snapshotable environment an agent acts in."""

    env_version: str

    def reset(self, task_id: str, seed: int) -> str:
        """Load the task's initial state with ``seed``; return the first observation."""
        ...

    def step(self, action: Action | str) -> Transition:
        """Execute one action (or raw model text, parsed here); every call consumes one step."""
        ...

    def export_state(self) -> bytes:
        """Return the canonical bytes of the authoritative state (what the verifier reads)."""
        ...

    def state_hash(self) -> str:
        """Return the content hash of the current state (files, RNG state, mock clock)."""
        ...

    def snapshot(self, label: str) -> SnapshotRef:
        """Capture the current state; the reference's hashes must be reproduced by restore."""
        ...

    def restore(self, snapshot: SnapshotRef) -> None:
        """Return to a captured state exactly (``SnapshotMismatchError`` if it cannot)."""
        ...

    def fork(self, snapshot: SnapshotRef, branch_id: str) -> AgentEnv:
        """Return an independent environment at ``snapshot``; writes in it are isolated."""
        ...


@runtime_checkable
class SealingEnv(AgentEnv, Protocol):
    """An ``AgentEnv`` that seals its terminal states (see the module docstring)."""

    def sealed_terminal(self) -> SnapshotRef:
        """The sealed snapshot of the ended episode (``EpisodeNotDoneError`` before the end)."""
        ...

    def export_sealed(self, ref: SnapshotRef) -> bytes:
        """The sealed state's bytes, checked against ``ref`` (``SnapshotMismatchError``)."""
        ...
