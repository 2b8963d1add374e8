"""Typed actions, their canonical text form, and the parser from model text.

Model text carries one action as a JSON object inside ``<tool_call>...</tool_call>``::

    <tool_call>{"name": "read_file", "arguments": {"path": "config.json"}}</tool_call>

The reserved names ``finish`` and ``abstain`` map to the two non-tool action kinds. Whitespace
inside the delimiters and the order of JSON keys do not matter: every textual variant of one call
parses to one ``Action`` whose canonical form (``Action.canonical_text``) is unique. Text before
the opening delimiter (a short rationale) is allowed and ignored; anything else is a parse error
with a reason, never silently repaired.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from closedloop.contracts.hashing import canonical_json
from closedloop.errors import ActionParseError, ContractError

ActionKind = Literal["tool", "finish", "abstain"]
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
PARSER_VERSION = "action-parser-v1"
RESERVED_NAMES: dict[str, ActionKind] = {"finish": "finish", "abstain": "abstain"}
MAX_ACTION_CHARS = 20_000
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


@dataclass(frozen=True)
class Action:
    """One environment action.

    kind: ``tool`` calls tool ``name`` with ``args``; ``finish`` declares the task done;
    ``abstain`` declares the task cannot be done safely. ``args`` holds JSON values only.
    """

    kind: ActionKind
    name: str
    args: dict[str, Any]

    def __post_init__(self) -> None:
        if self.kind not in ("tool", "finish", "abstain"):
            raise ContractError(f"action kind must be tool, finish or abstain, got {self.kind!r}")
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise ContractError(f"action name {self.name!r} is not a lower_snake identifier")
        if self.kind == "tool" and self.name in RESERVED_NAMES:
            raise ContractError(f"tool actions may not use the reserved name {self.name!r}")
        if self.kind != "tool" and self.name != self.kind:
            raise ContractError(f"a {self.kind} action must be named {self.kind!r}")
        if not isinstance(self.args, dict):
            raise ContractError("action args must be a JSON object")
        _check_json_value(self.args, "args")

    @classmethod
    def tool(cls, name: str, **args: Any) -> Action:
        """Build a tool call."""
        return cls("tool", name, dict(args))

    @classmethod
    def finish(cls, **args: Any) -> Action:
        """Build the finish action (optional arguments such as a message)."""
        return cls("finish", "finish", dict(args))

    @classmethod
    def abstain(cls, **args: Any) -> Action:
        """Build the abstain action."""
        return cls("abstain", "abstain", dict(args))

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON object form ``{"arguments": ..., "name": ...}``."""
        return {"name": self.name, "arguments": self.args}

    def canonical_json(self) -> str:
        """Return the canonical JSON of the call (sorted keys, compact)."""
        return canonical_json(self.to_dict())

    def canonical_text(self) -> str:
        """Return the canonical model text: the canonical JSON inside the delimiters."""
        return f"{TOOL_CALL_OPEN}{self.canonical_json()}{TOOL_CALL_CLOSE}"

    def model_text(self) -> str:
        """Return the call as demonstrations write it: ``name`` first, then the arguments in
        their given order (``path`` before ``old`` before ``new``), compact JSON.

        Sorted keys (the canonical form) would put ``arguments`` before ``name`` and ``new``
        before ``old``: a model would have to write the replacement before naming the tool or
        the text it replaces. Both forms parse to the same ``Action``.
        """
        body = json.dumps({"name": self.name, "arguments": self.args}, separators=(",", ":"),
                          ensure_ascii=False, allow_nan=False)
        return f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"


def parse_action(text: str) -> Action:
    """Parse exactly one action from model text; raise ``ActionParseError`` with a reason.

    Accepts optional free text before ``<tool_call>``, then one JSON object with keys ``name``
    (str) and optionally ``arguments`` (object), then ``</tool_call>`` and optional trailing
    whitespace. Rejects: no delimiter, an unclosed call, more than one call, text after the call,
    invalid JSON, unknown keys, a non-object ``arguments``, non-finite numbers, and bad names.
    """
    if not isinstance(text, str):
        raise ActionParseError("action text is not a string")
    if len(text) > MAX_ACTION_CHARS:
        raise ActionParseError(f"action text longer than {MAX_ACTION_CHARS} characters")
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        raise ActionParseError(f"no {TOOL_CALL_OPEN} found")
    body_start = start + len(TOOL_CALL_OPEN)
    end = text.find(TOOL_CALL_CLOSE, body_start)
    if end < 0:
        raise ActionParseError(f"{TOOL_CALL_OPEN} is not closed by {TOOL_CALL_CLOSE}")
    rest = text[end + len(TOOL_CALL_CLOSE):]
    if rest.strip():
        if TOOL_CALL_OPEN in rest:
            raise ActionParseError("more than one tool call in one action")
        raise ActionParseError("text after the tool call")
    if TOOL_CALL_OPEN in text[body_start:end]:
        raise ActionParseError("nested tool call")
    return _action_from_json_text(text[body_start:end])


def _action_from_json_text(body: str) -> Action:
    try:
        obj = json.loads(body, parse_constant=_reject_constant)
    except ActionParseError:
        raise
    except (ValueError, RecursionError) as exc:
        raise ActionParseError(f"tool call is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ActionParseError("tool call JSON must be an object")
    unknown = sorted(set(obj) - {"name", "arguments"})
    if unknown:
        raise ActionParseError(f"unknown keys in tool call: {unknown}")
    name = obj.get("name")
    if not isinstance(name, str):
        raise ActionParseError("tool call has no string 'name'")
    args = obj.get("arguments", {})
    if not isinstance(args, dict):
        raise ActionParseError("'arguments' must be a JSON object")
    kind: ActionKind = RESERVED_NAMES.get(name, "tool")
    try:
        return Action(kind, name, args)
    except ContractError as exc:
        raise ActionParseError(str(exc)) from None


def _reject_constant(token: str) -> Any:
    raise ActionParseError(f"non-finite number {token} in tool call")


def _check_json_value(value: Any, where: str, depth: int = 0) -> None:
    if depth > 32:
        raise ContractError(f"{where}: nested deeper than 32 levels")
    if value is None or isinstance(value, bool | str | int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ContractError(f"{where}: non-finite number")
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_json_value(item, f"{where}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ContractError(f"{where}: object keys must be strings")
            _check_json_value(item, f"{where}.{key}", depth + 1)
        return
    raise ContractError(f"{where}: {type(value).__name__} is not a JSON value")
