"""Workspace state: files, mock clock, seeded RNG, step counter and action-log summary.

A ``WorkspaceState`` is immutable. Every step builds a new one, sharing unchanged file strings
with its predecessor, so a snapshot is a reference and a restore is a hash check. Its canonical
form (``to_bytes``) is what ``export_state`` returns and what the verifier decodes with
``decode_state``; the state hash is the content hash of that form with file contents replaced by
their per-file sha256 (so hashing a step costs O(changed files), not O(workspace)).

Paths are POSIX, relative and normalized (``normalize_path``): no absolute paths, no ``..``, no
empty segments, no NUL, control characters or backslashes, and nothing under a reserved prefix
(``.grader/``, ``.closedloop/``), where grader and harness files would live.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from closedloop.contracts import Termination, canonical_json, content_hash, sha256_hex
from closedloop.errors import StateDecodeError, WorkspaceLimitError, WorkspacePathError

STATE_FORMAT = "closedloop-state-v1"
RESERVED_PREFIXES = (".grader", ".closedloop")
MAX_PATH_CHARS = 1024
MAX_SEGMENT_BYTES = 255
MAX_DEPTH = 32
MAX_DETAIL_CHARS = 200


@dataclass(frozen=True)
class WorkspaceLimits:
    """Caps on workspace content: bytes per file (UTF-8), total bytes, and number of files."""

    max_file_bytes: int = 256 * 1024
    max_total_bytes: int = 2 * 1024 * 1024
    max_files: int = 256


def is_reserved(path: str) -> bool:
    """Say whether a normalized path lies under a reserved prefix (case-insensitive)."""
    head = path.split("/", 1)[0].lower()
    return head in RESERVED_PREFIXES


def normalize_path(path: object, *, allow_root: bool = False) -> str:
    """Return the normalized form of a workspace path, or raise ``WorkspacePathError``.

    ``.`` segments are dropped; ``"."`` (and ``""`` after dropping) is the workspace root, which
    only ``allow_root=True`` accepts (it returns ``""``); a trailing ``/`` is accepted only then.
    Absolute paths, ``..`` and reserved prefixes raise with code ``path_denied``; other
    malformations (non-string, empty segment, NUL, control characters, backslash, a lone
    surrogate, too long, too deep) raise with code ``bad_arguments``.
    """
    if not isinstance(path, str):
        raise WorkspacePathError("bad_arguments", "path must be a string")
    if len(path) > MAX_PATH_CHARS:
        raise WorkspacePathError("bad_arguments", f"path longer than {MAX_PATH_CHARS} chars")
    if any(ord(c) < 32 or ord(c) == 127 for c in path) or "\\" in path:
        raise WorkspacePathError("bad_arguments", "path holds a control character or backslash")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise WorkspacePathError("bad_arguments", "path is not valid Unicode text") from None
    if path.startswith("/"):
        raise WorkspacePathError("path_denied", "absolute paths are outside the workspace",
                                 "path_escape")
    body = path[:-1] if allow_root and path.endswith("/") and path != "/" else path
    parts: list[str] = []
    for seg in body.split("/"):
        if seg == "..":
            raise WorkspacePathError("path_denied", "'..' leaves the workspace", "path_escape")
        if seg == "" and body != "":
            raise WorkspacePathError("bad_arguments", "path has an empty segment")
        if seg in ("", "."):
            continue
        if len(seg.encode("utf-8", "surrogatepass")) > MAX_SEGMENT_BYTES:
            raise WorkspacePathError("bad_arguments", "path segment too long")
        parts.append(seg)
    if len(parts) > MAX_DEPTH:
        raise WorkspacePathError("bad_arguments", f"path deeper than {MAX_DEPTH} levels")
    norm = "/".join(parts)
    if not norm and not allow_root:
        raise WorkspacePathError("bad_arguments", "path names the workspace root, not a file")
    if norm and is_reserved(norm):
        raise WorkspacePathError("path_denied", "path is under a reserved prefix",
                                 "reserved_path")
    return norm


def _text_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _utf8_len(text: str) -> int:
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise WorkspacePathError("bad_arguments", "content is not valid Unicode text") from None


def _parents(path: str) -> list[str]:
    """The directory prefixes of a normalized path: ``a/b/c`` -> ``[a, a/b]``."""
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


class FileTree(Mapping[str, str]):
    """An immutable map of normalized path -> text with cached per-file hashes and sizes.

    ``with_file``/``without`` return new trees that share every other entry.
    """

    __slots__ = ("_dirs", "_files", "_hashes", "_sizes", "_total")

    def __init__(self, files: Mapping[str, str] | None = None,
                 limits: WorkspaceLimits | None = None) -> None:
        self._files: dict[str, str] = {}
        self._hashes: dict[str, str] = {}
        self._sizes: dict[str, int] = {}
        self._dirs: set[str] = set()
        self._total = 0
        for path in sorted(files or {}):
            text = (files or {})[path]
            norm = normalize_path(path)
            if norm != path:
                raise WorkspacePathError("bad_arguments", f"path {path!r} is not normalized")
            self._put(norm, text)
        if limits is not None:
            self.check_limits(limits)

    def _put(self, path: str, text: str) -> None:
        if not isinstance(text, str):
            raise WorkspacePathError("bad_arguments", f"content of {path!r} is not text")
        parents = _parents(path)
        if path in self._files or path in self._dirs or any(d in self._files for d in parents):
            raise WorkspacePathError("bad_arguments", f"{path!r} clashes with an existing path")
        size = _utf8_len(text)
        self._dirs.update(parents)
        self._files[path] = text
        self._hashes[path] = _text_hash(text)
        self._sizes[path] = size
        self._total += size

    def __getitem__(self, path: str) -> str:
        return self._files[path]

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)

    @property
    def total_bytes(self) -> int:
        """Total UTF-8 size of all files."""
        return self._total

    def size(self, path: str) -> int:
        """UTF-8 size of one file."""
        return self._sizes[path]

    def hashes(self) -> dict[str, str]:
        """Return a fresh dict path -> hex sha256 of the file's UTF-8 bytes."""
        return dict(self._hashes)

    def check_limits(self, limits: WorkspaceLimits) -> None:
        """Raise ``WorkspaceLimitError`` if any cap is exceeded."""
        big = [p for p, n in self._sizes.items() if n > limits.max_file_bytes]
        if big:
            raise WorkspaceLimitError(f"{big[0]!r} exceeds {limits.max_file_bytes} bytes")
        if self._total > limits.max_total_bytes:
            raise WorkspaceLimitError(f"workspace exceeds {limits.max_total_bytes} bytes")
        if len(self._files) > limits.max_files:
            raise WorkspaceLimitError(f"workspace exceeds {limits.max_files} files")

    def is_dir(self, path: str) -> bool:
        """True if ``path`` is the root (``""``) or a prefix directory of some file."""
        return path == "" or path in self._dirs

    def with_file(self, path: str, text: str, limits: WorkspaceLimits) -> FileTree:
        """Return a tree with ``path`` set to ``text`` (path already normalized)."""
        new = self._copy()
        if path in new._files:
            new._total -= new._sizes.pop(path)
            del new._files[path], new._hashes[path]
        new._put(path, text)
        new.check_limits(limits)
        return new

    def _copy(self) -> FileTree:
        new = FileTree.__new__(FileTree)
        new._files = dict(self._files)
        new._hashes = dict(self._hashes)
        new._sizes = dict(self._sizes)
        new._dirs = set(self._dirs)
        new._total = self._total
        return new

    def verify(self) -> bool:
        """Recompute every per-file hash from content; True when all match the cache."""
        return all(_text_hash(t) == self._hashes[p] for p, t in self._files.items())


@dataclass(frozen=True)
class Violation:
    """A policy violation: the step it happened at, a code and a bounded detail."""

    step: int
    code: str
    detail: str


@dataclass(frozen=True)
class LogEntry:
    """One step of the action log: the action's name (``<invalid>`` if unparsable) and error."""

    step: int
    action: str
    error: str | None


@dataclass(frozen=True)
class Counters:
    """The action-log summary the verifier reads.

    tool_calls: parsed tool actions; invalid_actions: unparsable texts; tool_errors: tool calls
    that returned an error observation; commands_run: ``run`` calls that executed; timeouts:
    ``run`` calls killed at the time limit; violations: denied paths, disallowed tools or
    commands, sandbox refusals; log: one entry per step.
    """

    tool_calls: int = 0
    invalid_actions: int = 0
    tool_errors: int = 0
    commands_run: int = 0
    timeouts: int = 0
    violations: tuple[Violation, ...] = ()
    log: tuple[LogEntry, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """Return the JSON form."""
        return {
            "tool_calls": self.tool_calls, "invalid_actions": self.invalid_actions,
            "tool_errors": self.tool_errors, "commands_run": self.commands_run,
            "timeouts": self.timeouts,
            "violations": [{"step": v.step, "code": v.code, "detail": v.detail}
                           for v in self.violations],
            "log": [{"step": e.step, "action": e.action, "error": e.error} for e in self.log],
        }


def initial_rng_state(task_id: str, seed: int) -> tuple[Any, ...]:
    """Return the RNG state at reset: ``random.Random`` seeded from sha256(task_id, seed)."""
    digest = hashlib.sha256(canonical_json([task_id, seed]).encode("utf-8")).digest()
    return random.Random(int.from_bytes(digest[:16], "big")).getstate()


def rng_state_hash(rng_state: tuple[Any, ...]) -> str:
    """Return the content hash of a ``random.Random`` state."""
    return content_hash(_rng_to_json(rng_state))


def _rng_to_json(rng_state: tuple[Any, ...]) -> list[Any]:
    version, internal, gauss = rng_state
    return [version, list(internal), gauss]


@dataclass(frozen=True)
class WorkspaceState:
    """The authoritative state of one terminal-repair episode (immutable).

    files: the workspace; clock: mock clock in ticks (one per step); rng_state: the
    ``random.Random`` state, advanced only by draws the environment makes (one per ``run``);
    steps: steps consumed; done/termination/final_action (``finish``/``abstain``) after the end.
    """

    env_version: str
    task_id: str
    seed: int
    step_budget: int
    files: FileTree
    clock: int
    rng_state: tuple[Any, ...]
    rng_hash: str
    steps: int = 0
    counters: Counters = field(default_factory=Counters)
    done: bool = False
    termination: Termination | None = None
    final_action: str | None = None

    def _summary(self, files_json: Any, rng_json: Any) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT, "env_version": self.env_version, "task_id": self.task_id,
            "seed": self.seed, "step_budget": self.step_budget, "files": files_json,
            "clock": self.clock, "rng_state": rng_json, "steps": self.steps,
            "counters": self.counters.to_json(), "done": self.done,
            "termination": None if self.termination is None else self.termination.value,
            "final_action": self.final_action,
        }

    @cached_property
    def state_hash(self) -> str:
        """Content hash over files (per-file sha256), clock, RNG hash, steps, counters, end."""
        return content_hash(self._summary(self.files.hashes(), self.rng_hash))

    def recompute_hashes(self) -> tuple[str, str]:
        """Recompute (state hash, rng hash) from content, bypassing every cache."""
        rng_h = rng_state_hash(self.rng_state)
        files_h = {p: _text_hash(t) for p, t in self.files.items()}
        return content_hash(self._summary(files_h, rng_h)), rng_h

    def to_json(self) -> dict[str, Any]:
        """Return the full JSON form (file contents and RNG state included) with its hashes."""
        data = self._summary(dict(self.files), _rng_to_json(self.rng_state))
        data["state_hash"] = self.state_hash
        data["rng_state_hash"] = self.rng_hash
        return data

    def to_bytes(self) -> bytes:
        """Return the canonical bytes (what ``export_state`` returns)."""
        return canonical_json(self.to_json()).encode("utf-8")

    def bytes_hash(self) -> str:
        """Return the sha256 of ``to_bytes()``."""
        return sha256_hex(self.to_bytes())


ExportedState = WorkspaceState
"""The record ``decode_state`` returns: the same immutable ``WorkspaceState`` the env holds."""


def new_state(env_version: str, task_id: str, seed: int, step_budget: int,
              files: FileTree) -> WorkspaceState:
    """Return the reset state of an episode."""
    rng = initial_rng_state(task_id, seed)
    return WorkspaceState(env_version, task_id, seed, step_budget, files, 0, rng,
                          rng_state_hash(rng))


def draw_seed(state: WorkspaceState) -> tuple[int, WorkspaceState]:
    """Draw a 32-bit seed from the state's RNG; return it and the state with the RNG advanced."""
    rng = random.Random()
    rng.setstate(state.rng_state)
    value = rng.getrandbits(32)
    after = rng.getstate()
    return value, dataclasses.replace(state, rng_state=after, rng_hash=rng_state_hash(after))


_TOP_KEYS = frozenset({
    "format", "env_version", "task_id", "seed", "step_budget", "files", "clock", "rng_state",
    "steps", "counters", "done", "termination", "final_action", "state_hash", "rng_state_hash",
})


def decode_state(data: bytes) -> ExportedState:
    """Decode and validate exported state bytes; raise ``StateDecodeError`` naming the problem.

    Checks the JSON, every field's type, the paths, the RNG state, and that the recomputed
    state hash and RNG hash equal the recorded ones (so any altered byte is detected).
    """
    if not isinstance(data, bytes | bytearray):
        raise StateDecodeError("state must be bytes")
    try:
        obj = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise StateDecodeError(f"state is not UTF-8 JSON: {exc}") from None
    if not isinstance(obj, dict) or set(obj) != _TOP_KEYS:
        raise StateDecodeError("state must be an object with exactly the keys "
                               f"{sorted(_TOP_KEYS)}")
    if obj["format"] != STATE_FORMAT:
        raise StateDecodeError(f"unknown state format {obj['format']!r}")
    state = _build_state(obj)
    state_h, rng_h = state.recompute_hashes()
    if rng_h != obj["rng_state_hash"]:
        raise StateDecodeError("rng_state_hash does not match the RNG state")
    if state_h != obj["state_hash"]:
        raise StateDecodeError("state_hash does not match the state's content")
    return state


def _field(obj: Mapping[str, Any], key: str, tp: type | tuple[type, ...]) -> Any:
    value = obj.get(key)
    if isinstance(value, bool) and tp is int:
        raise StateDecodeError(f"field {key!r}: expected int, got bool")
    if not isinstance(value, tp):
        raise StateDecodeError(f"field {key!r}: wrong type {type(value).__name__}")
    return value


def _build_state(obj: Mapping[str, Any]) -> WorkspaceState:
    files_obj = _field(obj, "files", dict)
    try:
        files = FileTree(files_obj)
    except WorkspacePathError as exc:
        raise StateDecodeError(f"field 'files': {exc}") from None
    term_raw = obj.get("termination")
    try:
        termination = None if term_raw is None else Termination(term_raw)
    except ValueError:
        raise StateDecodeError(f"field 'termination': unknown code {term_raw!r}") from None
    final = obj.get("final_action")
    if final not in (None, "finish", "abstain"):
        raise StateDecodeError(f"field 'final_action': unexpected {final!r}")
    rng_state = _decode_rng(obj.get("rng_state"))
    return WorkspaceState(
        env_version=_field(obj, "env_version", str), task_id=_field(obj, "task_id", str),
        seed=_field(obj, "seed", int), step_budget=_field(obj, "step_budget", int),
        files=files, clock=_field(obj, "clock", int), rng_state=rng_state,
        rng_hash=_field(obj, "rng_state_hash", str), steps=_field(obj, "steps", int),
        counters=_decode_counters(_field(obj, "counters", dict)),
        done=_field(obj, "done", bool), termination=termination, final_action=final)


def _decode_rng(value: Any) -> tuple[Any, ...]:
    if not (isinstance(value, list) and len(value) == 3 and isinstance(value[1], list)):
        raise StateDecodeError("field 'rng_state': expected [version, [ints], gauss]")
    state = (value[0], tuple(value[1]), value[2])
    try:
        random.Random().setstate(state)
    except (TypeError, ValueError, OverflowError) as exc:
        raise StateDecodeError(f"field 'rng_state': {exc}") from None
    return state


_COUNTER_INTS = ("tool_calls", "invalid_actions", "tool_errors", "commands_run", "timeouts")


def _decode_counters(obj: Mapping[str, Any]) -> Counters:
    if set(obj) != {*_COUNTER_INTS, "violations", "log"}:
        raise StateDecodeError("field 'counters': wrong keys")
    ints = {k: _field(obj, k, int) for k in _COUNTER_INTS}
    try:
        violations = tuple(Violation(_int(v["step"]), _str(v["code"]), _str(v["detail"]))
                           for v in _field(obj, "violations", list))
        log = tuple(LogEntry(_int(e["step"]), _str(e["action"]),
                             None if e["error"] is None else _str(e["error"]))
                    for e in _field(obj, "log", list))
    except (KeyError, TypeError) as exc:
        raise StateDecodeError(f"field 'counters': malformed entry ({exc})") from None
    return Counters(**ints, violations=violations, log=log)


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError("expected an int")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("expected a string")
    return value


def bounded(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    """Cut an agent-controlled string to ``limit`` characters for logs and violation details."""
    return text if len(text) <= limit else text[:limit] + "..."
