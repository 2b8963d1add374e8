"""The verification contract (docs/concepts.md, clean-room verification): why the terminal state
deserves this reward.

Every environment package (``closedloop.envs.discovery.EnvPackage``) ships a ``TaskVerifier`` that
scores a task from the environment's *exported state bytes* only (``AgentEnv.export_state()``
or a sealed terminal's ``export_sealed``), never from a live environment or the agent's claims:

    verifier.score_or_quarantine(task_id, final_state: bytes) -> ScoreResult

A ``ScoreResult`` is either *scored*, a reward vector of named float components, every one
finite, that holds ``task_success`` (``SUCCESS_KEY``) in [0, 1], or *unscored*: reward ``None``
with the reason (tampering, a corrupt state, a verifier failure). Unscored is never 0. The
record checks itself on construction (``ContractError``).

``guarded`` wraps any verifier in a ``GuardedVerifier``, which enforces the contract at the
boundary: the verifier's own exception types, a wrong return type or a result for another task
become an unscored result whose reason names the error (a score outside the contract cannot be
built at all), so a user verifier that crashes quarantines the episode instead of stopping the
run. ``EnvPackage.verifier()`` returns its verifier guarded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from closedloop.errors import ContractError

__all__ = ["SUCCESS_KEY", "GuardedVerifier", "ScoreResult", "TaskVerifier", "guarded"]

SUCCESS_KEY = "task_success"
"""The reward component every scored result holds, in [0, 1]."""


@dataclass(frozen=True)
class ScoreResult:
    """A reward vector, or ``None`` with the reason the episode was left unscored.

    reward: named components (floats, finite); ``reward["task_success"]`` in [0, 1].
    quarantine_reason: why there is no reward (``tamper_detected: ...``, ``invalid_state: ...``,
    ``verifier_error: ...``); set exactly when ``reward`` is ``None``.
    verifier_version: the version of the verifier that decided.
    grade_reason: the grader's short reason (``"ok"`` on success), when scored.
    """

    task_id: str
    reward: dict[str, float] | None
    quarantine_reason: str | None
    verifier_version: str
    grade_reason: str | None = None

    def __post_init__(self) -> None:
        if (self.reward is None) == (self.quarantine_reason is None):
            raise ContractError(f"score of {self.task_id!r}: exactly one of reward and "
                                "quarantine_reason must be set")
        if not isinstance(self.verifier_version, str) or not self.verifier_version:
            raise ContractError(f"score of {self.task_id!r}: verifier_version must be a "
                                "non-empty string")
        if self.reward is not None:
            _check_reward(self.task_id, self.reward)

    @property
    def scored(self) -> bool:
        """True when a reward vector was produced."""
        return self.reward is not None

    @property
    def success(self) -> float | None:
        """``task_success`` in [0, 1], or ``None`` when unscored."""
        return None if self.reward is None else self.reward[SUCCESS_KEY]

    @classmethod
    def of(cls, task_id: str, success: float, verifier_version: str,
           components: Mapping[str, float] | None = None,
           reason: str | None = None) -> ScoreResult:
        """A scored result: ``task_success = success`` plus the other named components."""
        reward = {SUCCESS_KEY: float(success),
                  **{k: float(v) for k, v in (components or {}).items()}}
        return cls(task_id, reward, None, verifier_version, reason)

    @classmethod
    def unscored(cls, task_id: str, reason: str, verifier_version: str) -> ScoreResult:
        """An unscored result (reward ``None``) with its reason."""
        return cls(task_id, None, reason, verifier_version)


def _check_reward(task_id: str, reward: Mapping[str, float]) -> None:
    if not isinstance(reward, dict):
        raise ContractError(f"score of {task_id!r}: reward must be a dict of floats")
    for key, value in reward.items():
        if not isinstance(key, str) or isinstance(value, bool) or \
                not isinstance(value, int | float) or not math.isfinite(value):
            raise ContractError(f"score of {task_id!r}: reward component {key!r} = {value!r} "
                                "is not a finite number")
    success = reward.get(SUCCESS_KEY)
    if success is None:
        raise ContractError(f"score of {task_id!r}: reward has no {SUCCESS_KEY!r}")
    if not 0.0 <= success <= 1.0:
        raise ContractError(f"score of {task_id!r}: {SUCCESS_KEY} = {success} is outside "
                            "[0, 1]")


@runtime_checkable
class TaskVerifier(Protocol):
    """Scores a task's final state from its exported bytes (what an ``EnvPackage`` ships)."""

    @property
    def verifier_version(self) -> str:
        """The verifier's version string (recorded in every trajectory it scores)."""
        ...

    def score_or_quarantine(self, task_id: str, final_state: bytes) -> ScoreResult:
        """Score ``final_state`` (``AgentEnv.export_state()`` bytes) for ``task_id``."""
        ...


@dataclass(frozen=True)
class GuardedVerifier:
    """A ``TaskVerifier`` whose failures become unscored results (see ``guarded``)."""

    inner: TaskVerifier

    @property
    def verifier_version(self) -> str:
        """The wrapped verifier's version."""
        return str(self.inner.verifier_version)

    def score_or_quarantine(self, task_id: str, final_state: bytes) -> ScoreResult:
        """The inner verifier's result, or ``verifier_error: <Type>: <message>`` unscored."""
        version = self.verifier_version
        try:
            result = self.inner.score_or_quarantine(task_id, final_state)
        except Exception as exc:  # a user verifier's own error types are reported, not raised
            return ScoreResult.unscored(task_id, f"verifier_error: {type(exc).__name__}: "
                                        f"{exc}"[:500], version)
        if not isinstance(result, ScoreResult):
            return ScoreResult.unscored(task_id, "verifier_error: score_or_quarantine returned "
                                        f"{type(result).__name__}, not a ScoreResult", version)
        if result.task_id != task_id:
            return ScoreResult.unscored(task_id, f"verifier_error: asked for {task_id!r}, "
                                        f"scored {result.task_id!r}", version)
        return result


def guarded(verifier: TaskVerifier) -> GuardedVerifier:
    """Wrap ``verifier`` so that it never raises (idempotent)."""
    return verifier if isinstance(verifier, GuardedVerifier) else GuardedVerifier(verifier)
