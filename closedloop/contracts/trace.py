"""JSONL trace files: one record per line, validated on write and on read.

Reading names the 1-based line, the field and the reason of the first corrupt line
(``TraceFormatError``); nothing is skipped silently. ``assemble_episodes`` groups turn records
under their trajectory record and checks that token ids thread without gaps.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from closedloop.contracts.hashing import canonical_json
from closedloop.contracts.records import (
    RECORD_TYPES,
    GroupLease,
    TraceRecord,
    TrajectoryRecord,
    TurnRecord,
)
from closedloop.contracts.schema import decode_record, encode_record
from closedloop.errors import FieldError, TraceFormatError

_SURROGATE = re.compile("[\ud800-\udfff]")


def record_to_line(record: TraceRecord) -> str:
    """Return the canonical JSON line of a record (no trailing newline).

    A lone surrogate (model text such as ``"a\\udbff"`` parses to one) can only sit inside a
    JSON string, and is written as its ``\\uXXXX`` escape: the line is valid UTF-8 and reads
    back as the same record.
    """
    line = canonical_json(encode_record(record))
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", line)


def record_from_line(line: str, lineno: int = 1) -> TraceRecord:
    """Parse and validate one trace line; raise ``TraceFormatError`` naming line and field."""
    try:
        data = json.loads(line, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise TraceFormatError(lineno, "<line>", f"not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise TraceFormatError(lineno, "<line>", "a trace line must be a JSON object")
    kind = data.get("record")
    if kind not in RECORD_TYPES:
        raise TraceFormatError(lineno, "record",
                               f"must be one of {sorted(RECORD_TYPES)}, got {kind!r}")
    try:
        record: TraceRecord = decode_record(RECORD_TYPES[kind], data)
        return record
    except FieldError as exc:
        raise TraceFormatError(lineno, exc.field, exc.reason) from None


def _reject_constant(token: str) -> Any:
    raise ValueError(f"non-finite number {token}")


class TraceWriter:
    """Append records to a JSONL trace, one validated line each, flushed per record."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: IO[str] = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def write(self, record: TraceRecord) -> None:
        """Validate ``record`` by round-tripping it, then append it as one line."""
        line = record_to_line(record)
        record_from_line(line)
        self._fh.write(line + "\n")
        self._fh.flush()

    def write_all(self, records: Iterable[TraceRecord]) -> None:
        """Write several records, then fsync."""
        for record in records:
            self.write(record)
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        """Flush, fsync and close the file."""
        if not self._fh.closed:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_trace(path: str | Path) -> Iterator[TraceRecord]:
    """Yield every record of a trace; the first corrupt line raises ``TraceFormatError``
    naming the file and the line (bytes that are not UTF-8 and a line cut short by a crash
    included; a missing or unreadable file too, as line 0)."""
    try:
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    raise TraceFormatError(lineno, "<line>", "empty line", str(path))
                if not line.endswith("\n"):
                    raise TraceFormatError(lineno, "<line>", "the last line is cut short (no "
                                           "newline): the file was not closed", str(path))
                try:
                    yield record_from_line(line, lineno)
                except TraceFormatError as exc:
                    raise exc.in_file(path) from None
    except UnicodeDecodeError as exc:
        raise TraceFormatError(0, "<file>", f"not UTF-8 text ({exc.reason} at byte "
                               f"{exc.start})", str(path)) from None
    except OSError as exc:
        raise TraceFormatError(0, "<file>", f"cannot read: {exc.strerror or exc}",
                               str(path)) from None


@dataclass(frozen=True)
class Episode:
    """A trajectory record with its turn records in turn order."""

    trajectory: TrajectoryRecord
    turns: tuple[TurnRecord, ...]

    def context_token_ids(self, turn: int) -> list[int]:
        """Rebuild context(turn), the exact ids the sampler saw before action ``turn``."""
        ids: list[int] = []
        for t in self.turns[: turn + 1]:
            ids.extend(t.prompt_token_ids)
            if t.turn < turn:
                ids.extend(t.action_token_ids)
        return ids


def assemble_episodes(records: Iterable[TraceRecord]) -> tuple[list[GroupLease], list[Episode]]:
    """Group turn records under their trajectory; check threading and completeness.

    Raises ``TraceFormatError`` (line 0 = whole-trace check) for a turn without a trajectory, a
    gap in turn numbers, a ``context_len_before`` that does not match the threaded ids, or a
    turn whose behaviour version or manifest differs from its trajectory's (unless the
    trajectory is labelled ``mixed_policy``: a continuation under another version).
    """
    leases: list[GroupLease] = []
    turns: dict[str, list[TurnRecord]] = {}
    trajectories: list[TrajectoryRecord] = []
    for rec in records:
        if isinstance(rec, GroupLease):
            leases.append(rec)
        elif isinstance(rec, TurnRecord):
            turns.setdefault(rec.episode_id, []).append(rec)
        else:
            trajectories.append(rec)
    episodes = [_assemble_one(traj, turns.pop(traj.episode_id, [])) for traj in trajectories]
    if turns:
        orphan = sorted(turns)[0]
        raise TraceFormatError(0, "episode_id", f"turns of episode {orphan} have no trajectory")
    return leases, episodes


def _assemble_one(traj: TrajectoryRecord, turns: list[TurnRecord]) -> Episode:
    turns = sorted(turns, key=lambda t: t.turn)
    where = f"episode {traj.episode_id}"
    if [t.turn for t in turns] != list(range(len(turns))) or len(turns) != traj.num_turns:
        raise TraceFormatError(0, "turn", f"{where}: turns are not 0..{traj.num_turns - 1}")
    length = 0
    for t in turns:
        length += len(t.prompt_token_ids)
        if t.context_len_before != length:
            raise TraceFormatError(0, "context_len_before",
                                   f"{where} turn {t.turn}: threaded context has {length} "
                                   f"tokens, record says {t.context_len_before}")
        length += len(t.action_token_ids)
        if traj.mixed_policy:
            continue  # a labelled mixed-policy episode: each turn names its own version
        if t.behavior_policy_version != traj.behavior_policy_version:
            raise TraceFormatError(0, "behavior_policy_version",
                                   f"{where} turn {t.turn}: mixed behaviour versions")
        if t.policy_manifest_hash != traj.policy_manifest_hash:
            raise TraceFormatError(0, "policy_manifest_hash",
                                   f"{where} turn {t.turn}: manifest differs from trajectory")
    return Episode(traj, tuple(turns))


def load_episodes(path: str | Path) -> tuple[list[GroupLease], list[Episode]]:
    """Read a trace file and assemble its episodes; ``TraceFormatError`` names the file."""
    try:
        return assemble_episodes(read_trace(path))
    except TraceFormatError as exc:
        raise (exc if exc.path else exc.in_file(path)) from None
