"""The ledger's SQLite schema: group states, the legal transitions between them, the tables,
and the two statements every transition uses (read a group's state, append an event).

``groups`` holds one row per group id (its lease, summary and current state); ``events`` is
append-only: every transition, rejected attempt and reconciliation, in order. ``meta`` holds
``schema_version``; a file written with another version is refused by ``Ledger``.
"""

from __future__ import annotations

import sqlite3
import time
from typing import Literal

__all__ = ["GROUP_STATES", "LEGAL_TRANSITIONS", "SCHEMA_VERSION", "TABLES", "GroupState",
           "create_tables", "log_event", "state_of"]

SCHEMA_VERSION = 1
GroupState = Literal["collected", "admitted", "consumed", "quarantined", "discarded"]
GROUP_STATES: tuple[GroupState, ...] = (
    "collected", "admitted", "consumed", "quarantined", "discarded")
LEGAL_TRANSITIONS: frozenset[tuple[str, str]] = frozenset({
    ("collected", "admitted"), ("collected", "quarantined"), ("collected", "discarded"),
    ("admitted", "quarantined"), ("admitted", "discarded"), ("admitted", "consumed"),
})

TABLES = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS groups (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, group_id TEXT NOT NULL UNIQUE,
    run_id TEXT NOT NULL, task_id TEXT NOT NULL, behavior_policy_version TEXT NOT NULL,
    lease_json TEXT NOT NULL, lease_hash TEXT NOT NULL, summary_json TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN
        ('collected', 'admitted', 'consumed', 'quarantined', 'discarded')),
    reason TEXT, consumed_step INTEGER, output_policy_version TEXT,
    created_at REAL NOT NULL, updated_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS groups_state ON groups (state);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, group_id TEXT NOT NULL,
    kind TEXT NOT NULL CHECK (kind IN ('transition', 'rejected', 'reconciled')),
    from_state TEXT, to_state TEXT, reason TEXT, optimizer_step INTEGER,
    output_policy_version TEXT, at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS events_group ON events (group_id);
"""


def create_tables(cur: sqlite3.Cursor) -> None:
    """Create the tables and indexes that do not exist yet (idempotent)."""
    for statement in TABLES.split(";"):
        if statement.strip():
            cur.execute(statement)


def state_of(cur: sqlite3.Cursor, group_id: str) -> str | None:
    """The current state of ``group_id``, or None when the ledger never recorded it."""
    row = cur.execute("SELECT state FROM groups WHERE group_id=?", (group_id,)).fetchone()
    return None if row is None else str(row[0])


def log_event(cur: sqlite3.Cursor, group_id: str, kind: str, from_state: str | None,
              to_state: str | None, reason: str | None, step: int | None,
              version: str | None) -> None:
    """Append one row to the events table (``kind``: transition, rejected or reconciled)."""
    cur.execute("INSERT INTO events (group_id, kind, from_state, to_state, reason, "
                "optimizer_step, output_policy_version, at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (group_id, kind, from_state, to_state, reason, step, version, time.time()))

