"""Clean-room scoring of simulated episodes: exported bytes in, a ``ScoreResult`` out.

``SimVerifier`` decodes the exported state (``decode_sim_state``: canonical bytes only), checks
that it belongs to the task and environment version asked about and that the world still holds
the task's public data as generated (anything else is tampering), then hands the decoded state
and the task, hidden part included, to the environment's ``Grader``. Unscored results
(``ScoreResult.unscored``) carry ``invalid_state: ...`` or ``tamper_detected: ...``; unscored is
never 0. Every scored vector adds the environment's counters (``tool_calls``,
``invalid_actions``, ``tool_errors``) and the clock (``time_used``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from closedloop.contracts import ScoreResult
from closedloop.envs.sim.catalog import SimTask, TaskCatalog
from closedloop.envs.sim.state import SimState, decode_sim_state
from closedloop.errors import ClosedloopError, StateDecodeError


@dataclass(frozen=True)
class Grade:
    """A grader's decision: success in [0, 1], extra named components, a short reason."""

    success: float
    components: Mapping[str, float]
    reason: str


Grader = Callable[[SimTask, SimState], Grade]
"""Decide one task from its decoded final state (may raise ``StateDecodeError``)."""

PublicCheck = Callable[[SimTask, SimState], str | None]
"""Return tampering evidence (the world no longer holds the task's public data), or None."""


@dataclass(frozen=True)
class SimVerifier:
    """A ``TaskVerifier`` for one simulated environment."""

    catalog: TaskCatalog
    env_version: str
    grader: Grader
    public_check: PublicCheck
    verifier_version: str

    def score_or_quarantine(self, task_id: str, final_state: bytes) -> ScoreResult:
        """Score ``final_state`` for ``task_id`` (see the module docstring)."""
        try:
            task = self.catalog.task(task_id)
        except ClosedloopError as exc:
            return ScoreResult.unscored(task_id, f"unknown_task: {exc}", self.verifier_version)
        try:
            state = decode_sim_state(final_state)
        except StateDecodeError as exc:
            return ScoreResult.unscored(task_id, f"invalid_state: {exc}", self.verifier_version)
        evidence = self._tamper(task, state)
        if evidence is not None:
            return ScoreResult.unscored(task_id, f"tamper_detected: {evidence}",
                                        self.verifier_version)
        try:
            grade = self.grader(task, state)
        except StateDecodeError as exc:
            return ScoreResult.unscored(task_id, f"invalid_state: {exc}", self.verifier_version)
        components = {**counters(state), **grade.components}
        return ScoreResult.of(task_id, grade.success, self.verifier_version, components,
                              grade.reason)

    def _tamper(self, task: SimTask, state: SimState) -> str | None:
        if state.task_id != task.task_id:
            return f"state is for task {state.task_id!r}, not {task.task_id!r}"
        if state.env_version != self.env_version:
            return f"state env version {state.env_version!r} is not {self.env_version!r}"
        if state.budget != task.budget:
            return f"state budget {state.budget} is not the task's {task.budget}"
        return self.public_check(task, state)


def counters(state: SimState) -> dict[str, float]:
    """The environment's counters and clock as reward components."""
    c = state.counters
    return {"tool_calls": float(c.tool_calls), "invalid_actions": float(c.invalid_actions),
            "tool_errors": float(c.tool_errors), "time_used": float(state.clock)}


def world_field(world: Mapping[str, Any], key: str, tp: type | tuple[type, ...]) -> Any:
    """``world[key]`` of type ``tp``, else ``StateDecodeError`` naming the key."""
    if key not in world:
        raise StateDecodeError(f"world field {key!r} is missing")
    value = world[key]
    if not isinstance(value, tp) or (isinstance(value, bool) and bool not in _types(tp)):
        raise StateDecodeError(f"world field {key!r} has type {type(value).__name__}")
    return value


def _types(tp: type | tuple[type, ...]) -> tuple[type, ...]:
    return tp if isinstance(tp, tuple) else (tp,)
