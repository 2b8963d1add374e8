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
boundary. Only *declared* verifier failures become unscored results whose reason names the
error (``DECLARED_FAILURES``): ``VerifierFailure`` (the verifier's own timeout or limit),
``InfrastructureError`` and the built-in ``TimeoutError`` (the sandbox or a worker under it
failed), ``TamperDetected`` (``tamper_detected: ...``) and ``StateDecodeError`` (corrupt state
bytes, ``invalid_state: ...``). Anything else a verifier raises (a ``TypeError``, a
``KeyError``, a score outside the contract, which cannot be built) is a programming error: it
propagates with its traceback and a note naming the verifier and the task, and stops the run. A
wrong return type or a result for another task is one too (``ContractError``).
``EnvPackage.verifier()`` returns its verifier guarded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from closedloop.errors import (
    ContractError,
    InfrastructureError,
    StateDecodeError,
    TamperDetected,
    VerifierFailure,
)

__all__ = ["DECLARED_FAILURES", "SUCCESS_KEY", "GuardedVerifier", "ScoreResult", "TaskVerifier",
           "guarded"]

SUCCESS_KEY = "task_success"
"""The reward component every scored result holds, in [0, 1]."""

DECLARED_FAILURES: tuple[tuple[type[BaseException], str], ...] = (
    (TamperDetected, "tamper_detected"),
    (StateDecodeError, "invalid_state"),
    (VerifierFailure, "verifier_failure"),
    (InfrastructureError, "verifier_failure"),
    (TimeoutError, "verifier_failure"),
)
"""The exceptions a verifier may raise to leave an episode unscored, each with the reason's
prefix (first match wins); every other exception stops the run."""


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
    """A ``TaskVerifier`` whose declared failures become unscored results (see ``guarded``)."""

    inner: TaskVerifier

    @property
    def verifier_version(self) -> str:
        """The wrapped verifier's version."""
        return str(self.inner.verifier_version)

    def score_or_quarantine(self, task_id: str, final_state: bytes) -> ScoreResult:
        """The inner verifier's result, or ``<prefix>: <Type>: <message>`` unscored for a
        declared failure (``DECLARED_FAILURES``); raise anything else (a programming error)."""
        version = self.verifier_version
        try:
            result = self.inner.score_or_quarantine(task_id, final_state)
        except Exception as exc:
            prefix = _declared_prefix(exc)
            if prefix is None:
                exc.add_note(f"raised by verifier {version!r} scoring task {task_id!r} (a "
                             "programming error: only declared failures, e.g. VerifierFailure, "
                             "leave an episode unscored)")
                raise
            return ScoreResult.unscored(task_id, f"{prefix}: {type(exc).__name__}: "
                                        f"{exc}"[:500], version)
        if not isinstance(result, ScoreResult):
            raise ContractError(f"verifier {version!r}: score_or_quarantine({task_id!r}) "
                                f"returned {type(result).__name__}, not a ScoreResult")
        if result.task_id != task_id:
            raise ContractError(f"verifier {version!r}: asked for {task_id!r}, scored "
                                f"{result.task_id!r}")
        return result


def _declared_prefix(exc: BaseException) -> str | None:
    """The reason prefix of a declared verifier failure, or ``None`` for any other error."""
    for kind, prefix in DECLARED_FAILURES:
        if isinstance(exc, kind):
            return prefix
    return None


def guarded(verifier: TaskVerifier) -> GuardedVerifier:
    """Wrap ``verifier`` so that only its declared failures become unscored (idempotent)."""
    return verifier if isinstance(verifier, GuardedVerifier) else GuardedVerifier(verifier)
