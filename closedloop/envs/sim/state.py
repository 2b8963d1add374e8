"""``SimState``: the immutable state of a rule-driven text environment, and its exported form.

A simulated environment (key-and-door, shopping, SearchQA, a wrapped Gymnasium env) keeps its
whole world as one JSON object owned by its rules (``world``), beside the bookkeeping every
episode has: task id, seed, the time budget and the mock clock (macro-actions may cost more than
one unit), the step counter, the end of the episode, the action counters and a short action log.

The world is held as its canonical JSON text, so a state can never alias a caller's dict: every
``world()`` call returns a fresh copy. ``to_bytes`` is the canonical JSON of the whole state (what
``export_state`` returns and the verifier decodes with ``decode_sim_state``); ``state_hash`` is
its sha256. ``rng_hash`` covers the rules' entropy (``world["rng"]`` when the rules draw any;
a world without it draws nothing after reset).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from closedloop.contracts import Termination, canonical_json, content_hash, sha256_hex
from closedloop.errors import StateDecodeError

SIM_STATE_FORMAT = "closedloop-sim-state-v1"
MAX_LOG = 256


@dataclass(frozen=True)
class SimCounters:
    """Per-episode counters: tool calls, unparsable actions, tool calls that returned an error."""

    tool_calls: int = 0
    invalid_actions: int = 0
    tool_errors: int = 0

    def to_json(self) -> dict[str, int]:
        """Return the JSON form."""
        return {"tool_calls": self.tool_calls, "invalid_actions": self.invalid_actions,
                "tool_errors": self.tool_errors}


@dataclass(frozen=True)
class SimState:
    """One state of a simulated episode (immutable; see the module docstring).

    budget: time units per episode; ``clock >= budget`` ends it (task budget exhausted).
    log: (step, action name or ``<invalid>``, error code or None), the last ``MAX_LOG`` steps.
    """

    env_version: str
    task_id: str
    seed: int
    budget: int
    world_json: str
    clock: int = 0
    steps: int = 0
    done: bool = False
    termination: Termination | None = None
    final_action: str | None = None
    counters: SimCounters = field(default_factory=SimCounters)
    log: tuple[tuple[int, str, str | None], ...] = ()

    @classmethod
    def initial(cls, env_version: str, task_id: str, seed: int, budget: int,
                world: Mapping[str, Any]) -> SimState:
        """The state at reset: ``world`` is copied into its canonical JSON text."""
        return cls(env_version, task_id, seed, budget, canonical_json(dict(world)))

    def world(self) -> dict[str, Any]:
        """A fresh copy of the rules' world object."""
        value: dict[str, Any] = json.loads(self.world_json)
        return value

    def to_json(self) -> dict[str, Any]:
        """Return the JSON form (the world as an object)."""
        return {
            "format": SIM_STATE_FORMAT, "env_version": self.env_version,
            "task_id": self.task_id, "seed": self.seed, "budget": self.budget,
            "world": self.world(), "clock": self.clock, "steps": self.steps, "done": self.done,
            "termination": None if self.termination is None else self.termination.value,
            "final_action": self.final_action, "counters": self.counters.to_json(),
            "log": [list(entry) for entry in self.log],
        }

    @cached_property
    def _bytes(self) -> bytes:
        return canonical_json(self.to_json()).encode("utf-8")

    def to_bytes(self) -> bytes:
        """The canonical bytes of the whole state (what the verifier reads)."""
        return self._bytes

    @property
    def state_hash(self) -> str:
        """sha256 of ``to_bytes()``."""
        return sha256_hex(self._bytes)

    @property
    def rng_hash(self) -> str:
        """Content hash of the entropy the rules keep (``world["rng"]``) and the seed."""
        rng = self.world().get("rng")
        return content_hash({"seed": self.seed, "rng": rng})


def decode_sim_state(data: bytes) -> SimState:
    """Decode exported bytes strictly; ``StateDecodeError`` names the field that is wrong.

    The bytes must be the canonical form of the state they decode to (re-encoding is
    byte-equal), so a hand-edited or reordered export is rejected rather than trusted.
    """
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise StateDecodeError(f"sim state: not UTF-8 JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise StateDecodeError("sim state: not a JSON object")
    if obj.get("format") != SIM_STATE_FORMAT:
        raise StateDecodeError(f"sim state: field 'format' must be {SIM_STATE_FORMAT!r}")
    state = SimState(
        env_version=_get(obj, "env_version", str), task_id=_get(obj, "task_id", str),
        seed=_int(obj, "seed"), budget=_int(obj, "budget"),
        world_json=canonical_json(_get(obj, "world", dict)), clock=_int(obj, "clock"),
        steps=_int(obj, "steps"), done=_get(obj, "done", bool),
        termination=_termination(obj.get("termination")),
        final_action=_optional_str(obj, "final_action"),
        counters=_counters(_get(obj, "counters", dict)), log=_log(_get(obj, "log", list)))
    if state.to_bytes() != data:
        raise StateDecodeError("sim state: bytes are not the canonical form of their content")
    return state


def _get(obj: Mapping[str, Any], key: str, tp: type) -> Any:
    if key not in obj:
        raise StateDecodeError(f"sim state: field {key!r} is missing")
    value = obj[key]
    if not isinstance(value, tp) or (tp is not bool and isinstance(value, bool)):
        raise StateDecodeError(f"sim state: field {key!r} must be {tp.__name__}")
    return value


def _int(obj: Mapping[str, Any], key: str) -> int:
    value: int = _get(obj, key, int)
    if value < 0:
        raise StateDecodeError(f"sim state: field {key!r} must be >= 0")
    return value


def _optional_str(obj: Mapping[str, Any], key: str) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise StateDecodeError(f"sim state: field {key!r} must be a string or null")
    return value


def _termination(value: Any) -> Termination | None:
    if value is None:
        return None
    try:
        return Termination(value)
    except ValueError:
        raise StateDecodeError(f"sim state: field 'termination': unknown code {value!r}") from None


def _counters(obj: Mapping[str, Any]) -> SimCounters:
    if set(obj) != {"tool_calls", "invalid_actions", "tool_errors"}:
        raise StateDecodeError("sim state: field 'counters' has the wrong keys")
    return SimCounters(_int(obj, "tool_calls"), _int(obj, "invalid_actions"),
                       _int(obj, "tool_errors"))


def _log(items: list[Any]) -> tuple[tuple[int, str, str | None], ...]:
    out: list[tuple[int, str, str | None]] = []
    for item in items:
        if (not isinstance(item, list) or len(item) != 3 or not isinstance(item[0], int)
                or not isinstance(item[1], str) or not (item[2] is None or
                                                        isinstance(item[2], str))):
            raise StateDecodeError("sim state: field 'log' entries must be [step, name, error]")
        out.append((item[0], item[1], item[2]))
    return tuple(out)
