"""Snapshot references and transitions (seed 000 §2, the Transition Contract).

A snapshot is a state contract: ``state_hash`` covers the mutable world state and
``rng_state_hash`` the entropy sources; restoring it must reproduce both exactly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from closedloop.contracts.termination import Termination


@dataclass(frozen=True)
class SnapshotRef:
    """An immutable reference to a captured environment state."""

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
