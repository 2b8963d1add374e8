"""The group ledger: exactly-once consumption of sibling groups, in SQLite (docs/concepts.md,
exactly-once groups).

Every group moves through a small state machine, one SQLite transaction per transition::

    collected ──admit──> admitted ──mark_consumed──> consumed
        │                    │
        └──> quarantined(reason) / discarded(reason) <──┘

``consumed``, ``quarantined`` and ``discarded`` are final, with one exception:
:meth:`Ledger.reconcile_with_checkpoint` may send a ``consumed`` group back to ``admitted`` when
the trainer checkpoint it restored from never applied it (see the protocol below). Every legal
transition and every rejected attempt is appended to an ``events`` table, so duplicates,
losses and incomplete groups are counted separately.

Crash-safe consumption protocol (the trainer checkpoint is the commit point)
-----------------------------------------------------------------------------
1. The trainer takes ``admitted`` groups, checks them with :meth:`Ledger.require_admitted`
   and applies the update in memory.
2. It writes the checkpoint atomically (``closedloop.learn.checkpoint.save_checkpoint``): the
   cumulative ``consumed_group_ids``, ``optimizer_step`` and ``output_policy_version`` commit
   together with the weights in one directory rename.
3. Only then it calls :meth:`Ledger.mark_consumed` (one transaction for the whole batch).
4. On restart it loads the newest complete checkpoint and calls
   :meth:`Ledger.reconcile_with_checkpoint` before taking any group.

A crash before (2) commits leaves the groups ``admitted`` and the model at the previous
checkpoint, so they are applied exactly once after restart. A crash between (2) and (3) leaves
groups the checkpoint holds but the ledger does not: reconciliation marks them ``consumed`` (they
are never re-applied). If the newest checkpoint is lost or corrupt and the trainer falls back to
an older one, groups the ledger marked ``consumed`` at a later step were applied to weights that
no longer exist: reconciliation returns them to ``admitted`` so they are applied exactly once
more. A ``consumed`` group at or before the checkpoint's step that the checkpoint does not hold
cannot arise under this protocol and raises :class:`LedgerInconsistencyError`. The same
reconciliation also makes the opposite order (ledger first, then checkpoint) safe; the chosen
order keeps the ledger from ever claiming more than the committed weights hold, except after a
fall-back to an older checkpoint. If ``mark_consumed`` raises after a checkpoint committed, the
trainer must stop (or reconcile) before taking more groups.

The tables and states are in ``closedloop.rollout.ledger_schema``, the report records (events,
counts, exactly-once accounting, reconciliation) in ``closedloop.rollout.ledger_reports`` and
the file's integrity checks in ``closedloop.rollout.ledger_check``.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from closedloop.contracts.hashing import canonical_json, content_hash
from closedloop.contracts.records import GroupLease, TrajectoryRecord
from closedloop.errors import (
    DuplicateConsumptionError,
    DuplicateGroupError,
    IllegalTransitionError,
    LedgerCorruptError,
    LedgerError,
    LedgerInconsistencyError,
    LedgerSchemaError,
    UnknownGroupError,
)
from closedloop.rollout.ledger_check import (
    LedgerDigest,
    compute_digest,
    digest_problems,
    integrity_problems,
    row_problems,
)
from closedloop.rollout.ledger_reports import (
    ExactlyOnceReport,
    LedgerCounts,
    LedgerEvent,
    ReconcileReport,
    count_groups,
)
from closedloop.rollout.ledger_schema import (
    GROUP_STATES,
    LEGAL_TRANSITIONS,
    SCHEMA_VERSION,
    GroupState,
    create_tables,
    log_event,
    state_of,
)

__all__ = [
    "GROUP_STATES", "SCHEMA_VERSION", "DuplicateConsumptionError", "DuplicateGroupError",
    "ExactlyOnceReport", "GroupRow", "GroupState", "GroupSummary", "IllegalTransitionError",
    "Ledger", "LedgerCorruptError", "LedgerCounts", "LedgerError", "LedgerEvent",
    "LedgerInconsistencyError",
    "LedgerSchemaError", "ReconcileReport", "UnknownGroupError",
]


# ----------------------------------------------------------------------------- records
@dataclass(frozen=True)
class GroupSummary:
    """What the ledger keeps about a collected group's trajectories (JSON values only).

    ``n_trajectories`` below the lease's ``group_size`` makes the group *incomplete*.
    """

    n_trajectories: int
    n_censored: int = 0
    n_quarantined: int = 0
    task_family: str | None = None
    behavior_versions: tuple[str, ...] = ()
    episode_ids: tuple[str, ...] = ()
    total_action_tokens: int = 0

    def __post_init__(self) -> None:
        if min(self.n_trajectories, self.n_censored, self.n_quarantined,
               self.total_action_tokens) < 0:
            raise LedgerError("group summary counts must be >= 0")

    @classmethod
    def from_trajectories(cls, trajectories: Sequence[TrajectoryRecord]) -> GroupSummary:
        """Summarize the trajectories of one group."""
        families = sorted({t.task_family for t in trajectories})
        return cls(
            n_trajectories=len(trajectories),
            n_censored=sum(t.termination.is_censored for t in trajectories),
            n_quarantined=sum(t.quarantine_reason is not None for t in trajectories),
            task_family=families[0] if len(families) == 1 else None,
            behavior_versions=tuple(sorted({t.behavior_policy_version for t in trajectories})),
            episode_ids=tuple(t.episode_id for t in trajectories),
            total_action_tokens=sum(t.num_action_tokens for t in trajectories),
        )

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GroupSummary:
        """Rebuild a summary from its JSON form."""
        values = dict(data)
        for key in ("behavior_versions", "episode_ids"):
            values[key] = tuple(values.get(key, ()))
        return cls(**values)


@dataclass(frozen=True)
class GroupRow:
    """The ledger's current view of one group."""

    group_id: str
    state: GroupState
    reason: str | None
    lease: GroupLease
    summary: GroupSummary
    consumed_step: int | None
    output_policy_version: str | None
    updated_at: float

    @property
    def incomplete(self) -> bool:
        """True when fewer trajectories were collected than the lease's group size."""
        return self.summary.n_trajectories < self.lease.group_size


# ----------------------------------------------------------------------------- ledger
class Ledger:
    """An SQLite (WAL, ``synchronous=FULL``) ledger of group states; see the module docstring.

    Safe to share between threads of one process (a lock serializes use) and between
    processes opening the same file (SQLite locking; every write is ``BEGIN IMMEDIATE``).
    """

    def __init__(self, path: str | Path, *, busy_timeout_s: float = 30.0) -> None:
        self.path = Path(path)
        self._lock = threading.RLock()
        try:
            self._conn = sqlite3.connect(str(self.path), timeout=busy_timeout_s,
                                         isolation_level=None, check_same_thread=False)
            self._conn.row_factory = sqlite3.Row
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
            self._init_schema()
        except sqlite3.DatabaseError as exc:
            raise LedgerCorruptError(f"{self.path}: SQLite cannot open it ({exc})") from None

    def _init_schema(self) -> None:
        with self._tx() as cur:
            create_tables(cur)
            row = cur.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                cur.execute("INSERT INTO meta (key, value) VALUES ('schema_version', ?)",
                            (str(SCHEMA_VERSION),))
            elif int(row["value"]) != SCHEMA_VERSION:
                raise LedgerSchemaError(f"{self.path}: ledger schema version {row['value']}, "
                                        f"this code reads version {SCHEMA_VERSION}")

    def close(self) -> None:
        """Close the database connection."""
        with self._lock:
            self._conn.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Cursor]:
        """One write transaction: ``BEGIN IMMEDIATE`` ... ``COMMIT``, rolled back on error."""
        with self._lock:
            cur = self._conn.cursor()
            try:
                cur.execute("BEGIN IMMEDIATE")
                try:
                    yield cur
                except BaseException:
                    cur.execute("ROLLBACK")
                    raise
                cur.execute("COMMIT")
            except sqlite3.IntegrityError:
                raise
            except sqlite3.DatabaseError as exc:
                raise LedgerCorruptError(f"{self.path}: {exc}") from None

    # ------------------------------------------------------------------ integrity
    def digest(self) -> LedgerDigest:
        """A digest of every committed row (see ``closedloop.rollout.ledger_check``)."""
        with self._lock:
            return compute_digest(self._conn)

    def verify(self, digest: LedgerDigest | None = None) -> None:
        """Run SQLite's integrity check and the row checks, and compare the rows committed up
        to ``digest`` with it; ``LedgerCorruptError`` naming the file and the first problems.
        """
        try:
            with self._lock:
                problems = integrity_problems(self._conn)
                if not problems:
                    problems = row_problems(self._conn)
                if not problems and digest is not None:
                    problems = digest_problems(self._conn, digest)
        except sqlite3.DatabaseError as exc:
            problems = [str(exc)]
        if problems:
            raise LedgerCorruptError(f"{self.path}: " + "; ".join(problems[:5]))

    # ------------------------------------------------------------------ transitions
    def record_collected(self, lease: GroupLease, summary: GroupSummary) -> None:
        """Record a newly collected group in state ``collected``.

        Raises ``DuplicateGroupError`` (and logs a rejected event) when the id already exists.
        """
        lease_dict = asdict(lease)
        now = time.time()
        try:
            with self._tx() as cur:
                cur.execute(
                    "INSERT INTO groups (group_id, run_id, task_id, behavior_policy_version, "
                    "lease_json, lease_hash, summary_json, state, created_at, updated_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, 'collected', ?, ?)",
                    (lease.group_id, lease.run_id, lease.task_id, lease.behavior_policy_version,
                     canonical_json(lease_dict), content_hash(lease_dict),
                     canonical_json(summary.to_dict()), now, now))
                log_event(cur, lease.group_id, "transition", None, "collected", None, None, None)
        except sqlite3.IntegrityError:
            self._log_rejected([lease.group_id], "duplicate_collection")
            raise DuplicateGroupError(f"group {lease.group_id!r} was already recorded") from None

    def admit(self, group_id: str) -> None:
        """Move a ``collected`` group to ``admitted``."""
        self._transition([group_id], "admitted", None)

    def quarantine(self, group_id: str, reason: str) -> None:
        """Move a ``collected`` or ``admitted`` group to ``quarantined`` with a reason."""
        self._transition([group_id], "quarantined", _require_reason(reason))

    def discard(self, group_id: str, reason: str) -> None:
        """Move a ``collected`` or ``admitted`` group to ``discarded`` with a reason."""
        self._transition([group_id], "discarded", _require_reason(reason))

    def mark_consumed(self, group_ids: Iterable[str], optimizer_step: int,
                      output_policy_version: str) -> None:
        """Mark a batch of ``admitted`` groups ``consumed`` at ``optimizer_step``, atomically.

        Either every group of the batch is marked or none is. A group already ``consumed``
        raises ``DuplicateConsumptionError``; any other state raises
        ``IllegalTransitionError``; both log a rejected event per offending group. Call it
        after the trainer checkpoint holding this step has committed.
        """
        ids = list(group_ids)
        if len(set(ids)) != len(ids):
            dupes = sorted({g for g in ids if ids.count(g) > 1})
            self._log_rejected(dupes, "duplicate_consumption")
            raise DuplicateConsumptionError(dupes[0], "admitted", "consumed")
        if isinstance(optimizer_step, bool) or not isinstance(optimizer_step, int) \
                or optimizer_step < 0:
            raise LedgerError(f"optimizer_step must be an int >= 0, got {optimizer_step!r}")
        self._transition(ids, "consumed", None, optimizer_step, output_policy_version)

    def require_admitted(self, group_ids: Iterable[str]) -> None:
        """Check, before applying an update, that every group is ``admitted`` (read only).

        Raises (and logs) ``DuplicateConsumptionError`` for a group already consumed, so a
        duplicate is refused before it reaches the gradient, not only when it is marked.
        """
        with self._lock:
            states = {g: state_of(self._conn.cursor(), g) for g in group_ids}
        for gid, state in states.items():
            if state is None:
                raise UnknownGroupError(f"group {gid!r} is not in the ledger")
            if state != "admitted":
                cls = (DuplicateConsumptionError if state == "consumed"
                       else IllegalTransitionError)
                self._log_rejected([gid], "duplicate_consumption" if state == "consumed"
                                   else "illegal_transition", "consumed")
                raise cls(gid, state, "consumed")

    def _transition(self, ids: Sequence[str], to_state: GroupState, reason: str | None,
                    step: int | None = None, version: str | None = None) -> None:
        try:
            with self._tx() as cur:
                for gid in ids:
                    state = state_of(cur, gid)
                    if state is None:
                        raise UnknownGroupError(f"group {gid!r} is not in the ledger")
                    if (state, to_state) not in LEGAL_TRANSITIONS:
                        cls = (DuplicateConsumptionError if state == to_state == "consumed"
                               else IllegalTransitionError)
                        raise cls(gid, state, to_state)
                    cur.execute("UPDATE groups SET state=?, reason=?, consumed_step=?, "
                                "output_policy_version=?, updated_at=? WHERE group_id=?",
                                (to_state, reason, step, version, time.time(), gid))
                    log_event(cur, gid, "transition", state, to_state, reason, step, version)
        except IllegalTransitionError as exc:
            kind = ("duplicate_consumption" if isinstance(exc, DuplicateConsumptionError)
                    else "illegal_transition")
            self._log_rejected([exc.group_id], kind, to_state)
            raise

    def _log_rejected(self, ids: Sequence[str], reason: str,
                      to_state: str | None = None) -> None:
        with self._tx() as cur:
            for gid in ids:
                log_event(cur, gid, "rejected", state_of(cur, gid), to_state, reason, None, None)

    # ------------------------------------------------------------------ recovery
    def reconcile_with_checkpoint(self, consumed_ids_in_checkpoint: Iterable[str], step: int,
                                  output_policy_version: str | None = None) -> ReconcileReport:
        """Make the ledger agree with the restored trainer checkpoint (the source of truth).

        In one transaction: ids the checkpoint holds but the ledger has ``admitted`` become
        ``consumed`` at ``step``; groups the ledger has ``consumed`` at a step later than
        ``step`` that the checkpoint does not hold go back to ``admitted``. Raises
        ``LedgerInconsistencyError`` (changing nothing) for a checkpoint id the ledger lacks or
        holds in another state, or a group consumed at or before ``step`` that the checkpoint
        lacks.
        """
        in_ckpt = set(consumed_ids_in_checkpoint)
        marked: list[str] = []
        reverted: list[str] = []
        with self._tx() as cur:
            for gid in sorted(in_ckpt):
                state = state_of(cur, gid)
                if state == "admitted":
                    marked.append(gid)
                elif state != "consumed":
                    raise LedgerInconsistencyError(
                        f"checkpoint step {step} consumed group {gid!r}, ledger state {state}")
            rows = cur.execute("SELECT group_id, consumed_step FROM groups "
                               "WHERE state='consumed' ORDER BY group_id").fetchall()
            for row in rows:
                gid, at = row["group_id"], row["consumed_step"]
                if gid in in_ckpt:
                    continue
                if at is None or at <= step:
                    raise LedgerInconsistencyError(
                        f"group {gid!r} consumed at step {at} is missing from checkpoint {step}")
                reverted.append(gid)
            self._apply_reconcile(cur, marked, reverted, step, output_policy_version)
        return ReconcileReport(step, tuple(marked), tuple(reverted))

    @staticmethod
    def _apply_reconcile(cur: sqlite3.Cursor, marked: Sequence[str], reverted: Sequence[str],
                         step: int, version: str | None) -> None:
        now = time.time()
        for gid in marked:
            cur.execute("UPDATE groups SET state='consumed', consumed_step=?, "
                        "output_policy_version=?, updated_at=? WHERE group_id=?",
                        (step, version, now, gid))
            log_event(cur, gid, "reconciled", "admitted", "consumed", "in_checkpoint", step,
                      version)
        for gid in reverted:
            cur.execute("UPDATE groups SET state='admitted', consumed_step=NULL, "
                        "output_policy_version=NULL, updated_at=? WHERE group_id=?",
                        (now, gid))
            log_event(cur, gid, "reconciled", "consumed", "admitted", "not_in_checkpoint", step,
                      None)

    # ------------------------------------------------------------------ queries
    def get(self, group_id: str) -> GroupRow:
        """Return the current row of one group; ``UnknownGroupError`` if absent."""
        with self._lock:
            row = self._conn.execute("SELECT * FROM groups WHERE group_id=?",
                                     (group_id,)).fetchone()
        if row is None:
            raise UnknownGroupError(f"group {group_id!r} is not in the ledger")
        return _row(row)

    def group_ids(self, state: GroupState | None = None) -> list[str]:
        """Return group ids in collection order, optionally only those in ``state``."""
        sql = "SELECT group_id FROM groups"
        args: tuple[str, ...] = ()
        if state is not None:
            if state not in GROUP_STATES:
                raise LedgerError(f"unknown group state {state!r}")
            sql, args = sql + " WHERE state=?", (state,)
        with self._lock:
            rows = self._conn.execute(sql + " ORDER BY seq", args).fetchall()
        return [r["group_id"] for r in rows]

    def events(self, group_id: str | None = None) -> list[LedgerEvent]:
        """Return the event log in order, optionally for one group."""
        sql = "SELECT * FROM events"
        args: tuple[str, ...] = ()
        if group_id is not None:
            sql, args = sql + " WHERE group_id=?", (group_id,)
        with self._lock:
            rows = self._conn.execute(sql + " ORDER BY seq", args).fetchall()
        return [LedgerEvent(**dict(r)) for r in rows]

    def counts(self) -> LedgerCounts:
        """Count groups per state, incomplete groups, reasons and rejected attempts."""
        with self._lock:
            return count_groups(self._conn)

    def exactly_once_report(self, expected_group_ids: Iterable[str]) -> ExactlyOnceReport:
        """Account for every expected group id; see :class:`ExactlyOnceReport`."""
        expected = set(expected_group_ids)
        with self._lock:
            rows = {r["group_id"]: _row(r) for r in
                    self._conn.execute("SELECT * FROM groups").fetchall()}
            dup_rows = self._conn.execute(
                "SELECT group_id FROM events WHERE kind='rejected' AND reason IN "
                "('duplicate_collection', 'duplicate_consumption')").fetchall()
        dup_ids = [r["group_id"] for r in dup_rows]

        def pick(pred: Any) -> tuple[str, ...]:
            return tuple(sorted(g for g in expected if g in rows and pred(rows[g])))

        return ExactlyOnceReport(
            consumed_once=pick(lambda r: r.state == "consumed"),
            duplicate=tuple(sorted(set(dup_ids))),
            duplicate_attempts=len(dup_ids),
            lost=tuple(sorted(g for g in expected if g not in rows)),
            incomplete=pick(lambda r: r.incomplete),
            quarantined=pick(lambda r: r.state == "quarantined"),
            discarded=pick(lambda r: r.state == "discarded"),
            pending=pick(lambda r: r.state in ("collected", "admitted")),
            unexpected=tuple(sorted(g for g, r in rows.items()
                                    if r.state == "consumed" and g not in expected)),
        )


# ----------------------------------------------------------------------------- helpers
def _require_reason(reason: str) -> str:
    if not isinstance(reason, str) or not reason.strip():
        raise LedgerError("a quarantine or discard needs a non-empty reason")
    return reason


def _row(row: sqlite3.Row) -> GroupRow:
    lease_data = json.loads(row["lease_json"])
    return GroupRow(
        group_id=row["group_id"], state=row["state"], reason=row["reason"],
        lease=GroupLease(**lease_data),
        summary=GroupSummary.from_dict(json.loads(row["summary_json"])),
        consumed_step=row["consumed_step"], output_policy_version=row["output_policy_version"],
        updated_at=row["updated_at"])
