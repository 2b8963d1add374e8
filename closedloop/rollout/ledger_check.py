"""Integrity of a ledger file: SQLite's own check, row self-consistency, and a digest of the
committed rows that a trainer checkpoint carries.

Rows the ledger never rewrites make a verifiable prefix: every ``events`` row (the table is
append-only) and the immutable columns of every ``groups`` row (``seq`` through
``created_at``; only the state columns change after ``record_collected``). A
:class:`LedgerDigest` records how far each prefix reached when a checkpoint was written and a
sha256 over it; :func:`digest_problems` recomputes the hashes over the same prefixes of the file
on disk, so flipped bytes in any row committed before the checkpoint are found, and rows added
since are allowed. :func:`decode_problems` names rows whose text is not UTF-8 (SQLite stores
them; Python cannot read them). :func:`row_problems` checks what the digest cannot: every lease
still hashes to its ``lease_hash``, and every group's state, step and version are the ones its
last transition event says.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from closedloop.contracts.hashing import content_hash

__all__ = ["LedgerDigest", "compute_digest", "decode_problems", "digest_problems",
           "integrity_problems", "row_problems"]

_GROUP_COLUMNS = ("seq, group_id, run_id, task_id, behavior_policy_version, lease_json, "
                  "lease_hash, summary_json, created_at")
_EVENT_COLUMNS = ("seq, group_id, kind, from_state, to_state, reason, optimizer_step, "
                  "output_policy_version, at")


@dataclass(frozen=True)
class LedgerDigest:
    """sha256 of the groups rows with ``seq <= groups_upto`` (immutable columns) and of the
    events rows with ``seq <= events_upto``, in ``seq`` order."""

    groups_upto: int
    groups_hash: str
    events_upto: int
    events_hash: str

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (kept in a checkpoint's ``extra``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LedgerDigest:
        """Rebuild a digest from its JSON form (``KeyError``/``TypeError`` if malformed)."""
        return cls(int(data["groups_upto"]), str(data["groups_hash"]),
                   int(data["events_upto"]), str(data["events_hash"]))


def _hash_rows(conn: sqlite3.Connection, table: str, columns: str, upto: int) -> str:
    h = hashlib.sha256()
    for row in conn.execute(f"SELECT {columns} FROM {table} WHERE seq <= ? ORDER BY seq",
                            (upto,)):
        h.update(json.dumps(list(row), separators=(",", ":")).encode("utf-8", "surrogatepass"))
        h.update(b"\n")
    return "sha256:" + h.hexdigest()


def _max_seq(conn: sqlite3.Connection, table: str) -> int:
    return int(conn.execute(f"SELECT COALESCE(MAX(seq), 0) FROM {table}").fetchone()[0])


def compute_digest(conn: sqlite3.Connection) -> LedgerDigest:
    """The digest of every row committed so far."""
    groups, events = _max_seq(conn, "groups"), _max_seq(conn, "events")
    return LedgerDigest(groups, _hash_rows(conn, "groups", _GROUP_COLUMNS, groups),
                        events, _hash_rows(conn, "events", _EVENT_COLUMNS, events))


def digest_problems(conn: sqlite3.Connection, digest: LedgerDigest) -> list[str]:
    """How the file's rows differ from ``digest`` (empty when the prefixes match)."""
    problems = []
    for table, columns, upto, expected in (
            ("groups", _GROUP_COLUMNS, digest.groups_upto, digest.groups_hash),
            ("events", _EVENT_COLUMNS, digest.events_upto, digest.events_hash)):
        have = _max_seq(conn, table)
        if have < upto:
            problems.append(f"{table}: {upto} rows were committed, the file has {have}")
        elif _hash_rows(conn, table, columns, upto) != expected:
            problems.append(f"{table}: rows 1..{upto} do not match their recorded hash")
    return problems


def integrity_problems(conn: sqlite3.Connection) -> list[str]:
    """SQLite's ``PRAGMA integrity_check`` messages (empty for a sound file)."""
    rows = [str(r[0]) for r in conn.execute("PRAGMA integrity_check").fetchall()]
    return [] if rows == ["ok"] else rows


def decode_problems(conn: sqlite3.Connection) -> list[str]:
    """Rows SQLite stores but Python cannot read (text that is not UTF-8), by table and seq.

    Each row is read alone, so one bad row is named instead of stopping the scan."""
    problems: list[str] = []
    for table in ("meta", "groups", "events"):
        for (rowid,) in conn.execute(f"SELECT rowid FROM {table} ORDER BY rowid"):
            try:
                conn.execute(f"SELECT * FROM {table} WHERE rowid = ?", (rowid,)).fetchall()
            except sqlite3.OperationalError as exc:
                problems.append(f"{table} row {rowid}: {exc}")
                if len(problems) >= 5:
                    return problems
    return problems


def row_problems(conn: sqlite3.Connection, limit: int = 5) -> list[str]:
    """Rows that disagree with themselves or with their events (at most ``limit``)."""
    problems: list[str] = []
    last: dict[str, tuple[str, int | None, str | None]] = {}
    for gid, to_state, step, version in conn.execute(
            "SELECT group_id, to_state, optimizer_step, output_policy_version FROM events "
            "WHERE kind IN ('transition', 'reconciled') ORDER BY seq"):
        last[gid] = (to_state, step, version)
    for gid, lease_json, lease_hash, state, step, version in conn.execute(
            "SELECT group_id, lease_json, lease_hash, state, consumed_step, "
            "output_policy_version FROM groups ORDER BY seq"):
        try:
            ok_lease = content_hash(json.loads(lease_json)) == lease_hash
        except (ValueError, TypeError):
            ok_lease = False
        if not ok_lease:
            problems.append(f"group {gid!r}: lease_json does not hash to its lease_hash")
        expected = last.get(gid)
        if expected is None or expected[0] != state:
            problems.append(f"group {gid!r}: state {state!r}, its events say "
                            f"{expected[0] if expected else 'nothing'!r}")
        elif state == "consumed" and (step, version) != expected[1:]:
            problems.append(f"group {gid!r}: consumed at step {step} ({version}), its events "
                            f"say step {expected[1]} ({expected[2]})")
        if len(problems) >= limit:
            break
    return problems
