"""Gate records and options shared by every gate module (see ``closedloop.evaluate.gates``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from closedloop.errors import InvalidObjectiveError, UnknownObjectiveError
from closedloop.evaluate.rundir import RunDir
from closedloop.learn.objectives import get_objective

__all__ = ["Gate", "GateFn", "GateOptions", "GateReport", "make_gate"]

MAX_LISTED = 5


@dataclass(frozen=True)
class Gate:
    """One gate's verdict. ``evidence`` holds numbers with their denominators (JSON values)."""

    name: str
    passed: bool | None
    evidence: Mapping[str, Any]
    detail: str
    applicable: bool = True

    @property
    def status(self) -> str:
        """``PASS``, ``FAIL``, ``NOT MEASURED`` or ``N/A``."""
        if not self.applicable:
            return "N/A"
        return {True: "PASS", False: "FAIL", None: "NOT MEASURED"}[self.passed]

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"name": self.name, "status": self.status, "passed": self.passed,
                "applicable": self.applicable, "detail": self.detail,
                "evidence": dict(self.evidence)}


@dataclass(frozen=True)
class GateReport:
    """The gates of one run, in the go/no-go list's order (docs/gates.md).

    ``not_evaluated`` names the gates of the full list that were left out (``only=``): a
    partial report never counts as all passed.
    """

    run_dir: str
    gates: tuple[Gate, ...]
    not_evaluated: tuple[str, ...] = ()

    @property
    def all_passed(self) -> bool:
        """True only when every gate was evaluated and passed (not measured is no pass)."""
        return (bool(self.gates) and not self.not_evaluated
                and all(g.passed is True for g in self.gates))

    @property
    def failed(self) -> list[str]:
        """Names of failed gates."""
        return [g.name for g in self.gates if g.passed is False]

    @property
    def not_measured(self) -> list[str]:
        """Names of gates that could not be measured."""
        return [g.name for g in self.gates if g.passed is None]

    @property
    def exit_code(self) -> int:
        """0 all passed, 1 any failed, 3 none failed but not all were measured."""
        return 1 if self.failed else 0 if self.all_passed else 3

    def gate(self, name: str) -> Gate:
        """The gate called ``name`` (``KeyError`` if it was not evaluated)."""
        for g in self.gates:
            if g.name == name:
                return g
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"run_dir": self.run_dir, "all_passed": self.all_passed, "failed": self.failed,
                "not_measured": self.not_measured, "not_evaluated": list(self.not_evaluated),
                "gates": [g.to_dict() for g in self.gates]}


@dataclass(frozen=True)
class GateOptions:
    """How much the re-executing gates sample (deterministic given ``seed``).

    sample_episodes: episodes re-reset and replayed; fork_tasks: tasks given to ``check_env``;
    fixture_task_ids: the verifier audit's fixture tasks (None: the full default set);
    bootstrap: resamples for the shuffled-control interval.
    """

    sample_episodes: int = 6
    fork_tasks: int = 2
    fixture_task_ids: tuple[str, ...] | None = None
    bootstrap: int = 2000
    seed: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)


GateFn = Callable[[RunDir, GateOptions], Gate]


def make_gate(name: str, problems: Sequence[str], evidence: Mapping[str, Any], ok_detail: str,
              measured: bool = True, why_not: str = "") -> Gate:
    """Build a verdict: fail when ``problems``, else pass (or not measured)."""
    if problems:
        return Gate(name, False, evidence, "; ".join(problems[:MAX_LISTED]))
    if not measured:
        return Gate(name, None, evidence, why_not)
    return Gate(name, True, evidence, ok_detail)




def ratio_free(objective: str) -> bool:
    """Whether a run's objective (its ``update.objective``: a registered name or a dotted path)
    has no ratio against π_beh, as the objective itself says (``uses_ratio``). One that cannot
    be resolved here (a dotted path no longer importable) counts as ratio-free, so the stricter
    checks apply (fail closed)."""
    try:
        return not get_objective(objective).uses_ratio
    except (UnknownObjectiveError, InvalidObjectiveError):
        return True
