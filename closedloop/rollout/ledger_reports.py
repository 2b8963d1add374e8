"""What the ledger reports: its event rows, the counts per state and of rejected attempts,
the exactly-once accounting of an expected set of groups, and what a reconciliation changed."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["ExactlyOnceReport", "LedgerCounts", "LedgerEvent", "ReconcileReport",
           "count_groups"]


@dataclass(frozen=True)
class LedgerEvent:
    """One row of the append-only events table."""

    seq: int
    group_id: str
    kind: Literal["transition", "rejected", "reconciled"]
    from_state: str | None
    to_state: str | None
    reason: str | None
    optimizer_step: int | None
    output_policy_version: str | None
    at: float


@dataclass(frozen=True)
class LedgerCounts:
    """Groups per current state plus the rejected attempts, counted separately.

    ``incomplete`` counts groups (in any state) collected with fewer trajectories than their
    lease's group size; ``reasons`` counts quarantined and discarded groups by reason.
    """

    collected: int
    admitted: int
    consumed: int
    quarantined: int
    discarded: int
    incomplete: int
    duplicate_collections_rejected: int
    duplicate_consumptions_rejected: int
    illegal_transitions_rejected: int
    reverted_by_reconcile: int
    reasons: Mapping[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Number of distinct groups recorded."""
        return (self.collected + self.admitted + self.consumed + self.quarantined
                + self.discarded)

    @property
    def duplicates_rejected(self) -> int:
        """Duplicate collections plus duplicate consumptions that were refused."""
        return self.duplicate_collections_rejected + self.duplicate_consumptions_rejected


@dataclass(frozen=True)
class ExactlyOnceReport:
    """Exactly-once accounting of an expected set of group ids (gate ``exactly_once_groups``).

    consumed_once: expected ids consumed exactly once. duplicate: ids with at least one refused
    duplicate collection or consumption (``duplicate_attempts`` counts the attempts). lost:
    expected ids the ledger never recorded. incomplete: expected ids collected with fewer
    trajectories than the group size. quarantined / discarded: expected ids dropped with a
    reason. pending: expected ids still ``collected`` or ``admitted``. unexpected: consumed ids
    that were not expected. Each tuple is sorted.
    """

    consumed_once: tuple[str, ...]
    duplicate: tuple[str, ...]
    duplicate_attempts: int
    lost: tuple[str, ...]
    incomplete: tuple[str, ...]
    quarantined: tuple[str, ...]
    discarded: tuple[str, ...]
    pending: tuple[str, ...]
    unexpected: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """True when nothing is lost, pending or unexpected and no duplicate got through.

        Refused duplicate attempts are counted but do not fail the gate: they never reached
        the trainer.
        """
        return not (self.lost or self.pending or self.unexpected)

    def counts(self) -> dict[str, int]:
        """Return the size of each category."""
        out = {name: len(getattr(self, name)) for name in (
            "consumed_once", "duplicate", "lost", "incomplete", "quarantined", "discarded",
            "pending", "unexpected")}
        out["duplicate_attempts"] = self.duplicate_attempts
        return out


@dataclass(frozen=True)
class ReconcileReport:
    """What :meth:`Ledger.reconcile_with_checkpoint` changed (sorted group ids)."""

    checkpoint_step: int
    marked_consumed: tuple[str, ...]
    reverted_to_admitted: tuple[str, ...]


def count_groups(conn: sqlite3.Connection) -> LedgerCounts:
    """Count groups per state, incomplete groups, reasons and rejected attempts."""
    per_state = dict(conn.execute("SELECT state, COUNT(*) FROM groups GROUP BY state"))
    reasons = dict(conn.execute("SELECT reason, COUNT(*) FROM groups WHERE reason IS NOT "
                                "NULL GROUP BY reason"))
    rejected = dict(conn.execute("SELECT reason, COUNT(*) FROM events WHERE "
                                 "kind='rejected' GROUP BY reason"))
    reverted = conn.execute("SELECT COUNT(*) FROM events WHERE kind='reconciled' AND "
                            "to_state='admitted'").fetchone()[0]
    summaries = conn.execute("SELECT lease_json, summary_json FROM groups").fetchall()
    incomplete = sum(json.loads(s)["n_trajectories"] < json.loads(le)["group_size"]
                     for le, s in summaries)
    dup_coll = rejected.pop("duplicate_collection", 0)
    dup_cons = rejected.pop("duplicate_consumption", 0)
    return LedgerCounts(
        collected=per_state.get("collected", 0), admitted=per_state.get("admitted", 0),
        consumed=per_state.get("consumed", 0), quarantined=per_state.get("quarantined", 0),
        discarded=per_state.get("discarded", 0), incomplete=incomplete,
        duplicate_collections_rejected=dup_coll, duplicate_consumptions_rejected=dup_cons,
        illegal_transitions_rejected=sum(rejected.values()),
        reverted_by_reconcile=reverted, reasons=reasons)
