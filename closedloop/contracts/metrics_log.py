"""``metrics.jsonl``: one JSON object per line, each key written exactly once.

A record is a JSON object with a string ``kind`` and optionally an int ``step`` and a string
``label``; its key is ``(kind, step, label)`` (``None`` where absent). :class:`MetricsLog`
keeps at most one line per key, so a resumed run neither repeats a record (an evaluation
logged again on every launch) nor needs to append a second one:

- ``put(record)``: a new key is appended (write, flush, fsync); a key already present with the
  same content, ignoring the volatile fields ``VOLATILE`` (wall-clock time and durations), is
  left as it is; with other content the file is replaced atomically, the new line in the old
  one's place.
- opening reads every line: each must be a JSON object with a valid key, no key twice. A last
  line without its newline is the record a killed writer never finished: it is cut off
  (``repaired_tail`` says so) and never appended to; the resumed run writes that record again.
  Any other bad line raises :class:`MetricsFormatError` naming the file, line and field.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from closedloop.errors import MetricsFormatError

__all__ = ["VOLATILE", "MetricsFormatError", "MetricsKey", "MetricsLog", "metrics_key",
           "read_metrics"]

MetricsKey = tuple[str, int | None, str | None]
VOLATILE = frozenset({"time", "seconds", "timing"})
"""Fields that differ between two honest writes of one record (never compared): wall-clock
time, durations, and ``timing`` (what depends on when concurrent roles ran: queue ages,
waits, high-water marks)."""


def metrics_key(record: Mapping[str, Any]) -> MetricsKey:
    """``(kind, step, label)`` of a record; ``ValueError`` naming the field if malformed."""
    kind, step, label = record.get("kind"), record.get("step"), record.get("label")
    if not isinstance(kind, str) or not kind:
        raise ValueError("kind: must be a non-empty string")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise ValueError(f"step: must be an int, got {step!r}")
    if label is not None and not isinstance(label, str):
        raise ValueError(f"label: must be a string, got {label!r}")
    return kind, step, label


def _stable(record: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in VOLATILE}


def _line(record: Mapping[str, Any]) -> str:
    return json.dumps(record, sort_keys=True, default=str)


def _parse(path: Path, lines: list[str]) -> dict[MetricsKey, dict[str, Any]]:
    out: dict[MetricsKey, dict[str, Any]] = {}
    for lineno, text in enumerate(lines, start=1):
        try:
            record = json.loads(text)
        except ValueError as exc:
            raise MetricsFormatError(path, lineno, "<line>", f"not valid JSON ({exc})") from None
        if not isinstance(record, dict):
            raise MetricsFormatError(path, lineno, "<line>", "not a JSON object")
        try:
            key = metrics_key(record)
        except ValueError as exc:
            field, _, reason = str(exc).partition(": ")
            raise MetricsFormatError(path, lineno, field, reason) from None
        if key in out:
            raise MetricsFormatError(path, lineno, "kind", f"key {key} repeats an earlier line")
        out[key] = record
    return out


def _split(path: Path) -> tuple[list[str], bool]:
    """The file's complete lines, and whether a last line without its newline followed."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], False
    except OSError as exc:
        raise MetricsFormatError(path, 0, "<file>", f"cannot read: {exc.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MetricsFormatError(path, 0, "<file>", f"not UTF-8 at byte {exc.start}") from None
    torn = bool(text) and not text.endswith("\n")
    lines = text.split("\n")[:-1]  # the part after the last newline is "" or the torn line
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            raise MetricsFormatError(path, lineno, "<line>", "empty line")
    return lines, torn


def read_metrics(path: str | Path) -> tuple[dict[str, Any], ...]:
    """Every record of a metrics file in order (read only; a torn last line is an error)."""
    p = Path(path)
    lines, torn = _split(p)
    if torn:
        raise MetricsFormatError(p, len(lines) + 1, "<line>", "cut short (no newline): the "
                                 "writer was killed mid-line")
    return tuple(_parse(p, lines).values())


class MetricsLog:
    """The keyed, exactly-once writer of one metrics file (one writer per file)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        lines, torn = _split(self.path)
        self._records = _parse(self.path, lines)
        self.repaired_tail = torn
        if torn:
            self._rewrite()

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(list(self._records.values()))

    def __len__(self) -> int:
        return len(self._records)

    def get(self, key: MetricsKey) -> dict[str, Any] | None:
        """The record stored under ``key``, if any."""
        return self._records.get(key)

    def put(self, record: Mapping[str, Any]) -> bool:
        """Store ``record`` under its key (see the module docstring); True if the file changed.

        ``ValueError`` for a malformed key or a record JSON cannot hold.
        """
        key = metrics_key(record)
        new = dict(record)
        line = _line(new)
        json.loads(line)  # default=str may not hide a value that does not round-trip
        old = self._records.get(key)
        if old is not None and _stable(json.loads(_line(old))) == _stable(json.loads(line)):
            return False
        self._records[key] = new
        if old is None:
            self._append(line)
        else:
            self._rewrite()
        return True

    def _append(self, line: str) -> None:
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def _rewrite(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write("".join(_line(r) + "\n" for r in self._records.values()))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
