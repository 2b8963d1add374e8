"""The transition contract (docs/concepts.md, snapshot fidelity): what happened in the environment.

An environment (``AgentEnv``) is a resettable, snapshotable world an agent acts in. It owes:

- **Exact reset.** ``reset(task_id, seed)`` loads the task's initial state; the same
  ``(task_id, seed)`` gives the same first observation and the same ``state_hash()`` every time.
- **Typed actions, one step each.** ``step`` takes an ``Action`` or raw model text (parsed by
  the env with ``closedloop.contracts.parse_action``) and returns a ``Transition``. Every call
  consumes one step. Text that does not parse as an action returns a structured error
  observation (``Transition.error`` set) and changes nothing but the step, clock and counters;
  its effect must not depend on the text (two different unparsable texts from one state lead to
  one state). An action that fails returns its error code the same way. ``step`` never raises
  for anything a model can write.
- **Authoritative state for the verifier.** ``export_state()`` returns the canonical bytes of
  the whole state; the verifier scores those bytes, never a live env, and the env never scores
  itself. ``state_hash()`` is the content hash of the same state.
- **Snapshots.** ``snapshot(label)`` returns a ``SnapshotRef`` whose ``state_hash`` covers the
  mutable world state and ``rng_state_hash`` the entropy sources. ``restore(ref)`` returns to it
  exactly (re-deriving both hashes; ``SnapshotMismatchError`` if they differ), so restore and
  replay of the same actions reproduce the same observations, state hashes and reward.
  ``fork(ref, branch_id)`` returns an independent env at ``ref``: writes in a fork reach neither
  its parent, its siblings nor the snapshot, and ``branch_id`` never changes the env's RNG.

``SealingEnv`` adds sealing: when an episode ends its terminal state is sealed, exported for the
verifier by ``export_sealed`` and never restorable or forkable into an agent-facing env
(``SealedSnapshotError``), nor steppable (``EpisodeDoneError``). An env without it cannot seal;
the seal gate says so by name. ``closedloop.envs.check_env`` tests these clauses on any env.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

from closedloop.contracts.action import Action
from closedloop.contracts.termination import Termination

__all__ = ["Action", "AgentEnv", "SealingEnv", "SnapshotRef", "Termination", "Transition"]


@dataclass(frozen=True)
class SnapshotRef:
    """An immutable reference to a captured environment state.

    state_hash: the content hash of the mutable world state; rng_state_hash: of the entropy
    sources (RNG, mock clock); restoring the snapshot must reproduce both exactly.
    parent_snapshot_id: the snapshot this env last captured or restored before this one.
    """

    snapshot_id: str
    parent_snapshot_id: str | None
    env_version: str
    state_hash: str
    rng_state_hash: str
    label: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form."""
        return asdict(self)


@dataclass(frozen=True)
class Transition:
    """What one ``step`` returns.

    observation: the raw text the agent sees next (a structured JSON error for invalid actions).
    done: the episode is over; ``termination`` then says why.
    state_version: the content hash of the world state after the step.
    step_index: the number of steps consumed so far, this one included.
    error: ``None`` for a valid action, else a short error code (``invalid_action``,
    ``unknown_tool``, ``tool_not_allowed``, ``bad_arguments``, ``path_denied``,
    ``command_failed``...).
    """

    observation: str
    done: bool
    state_version: str
    step_index: int
    termination: Termination | None = None
    error: str | None = None


@runtime_checkable
class AgentEnv(Protocol):
    """A resettable, snapshotable environment an agent acts in (see the module docstring)."""

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
