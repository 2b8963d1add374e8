"""The package check: the environment contract checker and the verifier FP/FN audit on one
environment package, before anything trains on it (``closedloop check PACKAGE``; ``closedloop
train`` runs it before its first step and stops on a failure).

Two parts, each with what it found wrong (``problems``: the package fails when any) and what it
could not check (``notes``):

- **environment** (``closedloop.envs.check.check_package``): reset and step determinism,
  snapshot -> restore -> replay, unparsable text, fork isolation, the env version, and the
  verifier accepting the scripted expert's final state and rejecting the reset state. The first
  ``EnvCheckError`` is the problem (it names task, seed and step).
- **verifier** (``closedloop.envs.verifier_audit.audit_verifier`` on the package's adjudicated
  fixtures, docs/concepts.md, verifier FP/FN audit): ``full`` holds the audit to the
  preregistered bounds of the ``verifier_fp_fn`` gate (the upper end of the Wilson 95% interval
  of the FP rate at most ``FP_UPPER_BOUND``, of the FN rate at most ``FN_UPPER_BOUND``, every
  tamper fixture quarantined); ``quick`` audits the fixtures of one task, too few for those
  intervals, and requires no disagreement at all (FP = FN = 0, no tamper missed). A package
  without fixtures gets a note, not a failure (the gate then reports "not measured").

Modes: ``full`` (three tasks, two seeds, three action sequences each; every fixture), ``quick``
(one train task, one seed, one sequence; that task's fixtures), ``off`` (nothing; recorded).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from closedloop.envs.check import check_package
from closedloop.envs.verifier_audit import VerifierAudit, audit_verifier
from closedloop.errors import EnvCheckError, PackageCheckError

if TYPE_CHECKING:
    from closedloop.contracts.package import EnvPackage

__all__ = ["FN_UPPER_BOUND", "FP_UPPER_BOUND", "PACKAGE_CHECK_FILE", "CheckMode", "PackageCheck",
           "check_before_training", "check_environment_package", "record_check",
           "verifier_audit_problems"]

FP_UPPER_BOUND = 0.10
"""Preregistered bound on the upper end of the FP rate's Wilson 95% interval."""
FN_UPPER_BOUND = 0.15
"""Preregistered bound on the upper end of the FN rate's Wilson 95% interval."""
PACKAGE_CHECK_FILE = "package_check.json"
"""Where a run directory records the check its first launch ran."""

CheckMode = Literal["full", "quick", "off"]


@dataclass(frozen=True)
class PackageCheck:
    """One package check: the environment checker's report and the verifier audit (JSON
    forms; ``None`` when not run), what failed and what could not be checked."""

    env_id: str
    env_version: str
    mode: str
    environment: dict[str, Any] | None
    verifier: dict[str, Any] | None
    problems: tuple[str, ...]
    notes: tuple[str, ...]

    @property
    def passed(self) -> bool:
        """True when nothing failed (a part that could not run is a note, not a failure)."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """The JSON form, with ``passed``."""
        return {**dataclasses.asdict(self), "passed": self.passed}

    def lines(self) -> list[str]:
        """A human summary: one line per part, then each problem and note."""
        env = self.environment or {}
        out = [f"package {self.env_id} ({self.env_version}), {self.mode} check: "
               f"{'PASSED' if self.passed else 'FAILED'}"]
        if env.get("summary"):
            out.append(f"  environment: {env['summary']}")
        if self.verifier is not None:
            out.append(f"  verifier: {self.verifier.get('summary')}")
        out += [f"  FAIL {p}" for p in self.problems] + [f"  note: {n}" for n in self.notes]
        return out


def verifier_audit_problems(audit: VerifierAudit, strict: bool = False) -> list[str]:
    """What keeps ``audit`` from passing: the preregistered interval bounds (``strict``: any
    disagreement), a missing denominator, a tamper fixture that was not quarantined."""
    problems: list[str] = []
    if audit.fp_ci is None or audit.fn_ci is None:
        problems.append(f"no denominator: {audit.n_negative} negatives, {audit.n_positive} "
                        "positives")
    elif strict:
        if audit.fp or audit.fn:
            problems.append(f"FP {audit.fp}/{audit.n_negative}, FN {audit.fn}/"
                            f"{audit.n_positive}: disagreements {list(audit.disagreements[:5])}")
    else:
        if audit.fp_ci[1] > FP_UPPER_BOUND:
            problems.append(f"FP {audit.fp}/{audit.n_negative}: upper CI {audit.fp_ci[1]:.3f}"
                            f" > {FP_UPPER_BOUND}")
        if audit.fn_ci[1] > FN_UPPER_BOUND:
            problems.append(f"FN {audit.fn}/{audit.n_positive}: upper CI {audit.fn_ci[1]:.3f}"
                            f" > {FN_UPPER_BOUND}")
    if audit.tamper_missed:
        problems.append(f"{audit.tamper_missed}/{audit.n_tamper} tamper fixtures not quarantined")
    return problems


def _environment_part(package: EnvPackage, mode: CheckMode) -> tuple[dict[str, Any],
                                                                      list[str], list[str]]:
    from closedloop.contracts.package import TaskSetRequest

    kwargs: dict[str, Any] = {}
    if mode == "quick":
        sets = package.task_sets(TaskSetRequest(1, 1, 0))
        kwargs = {"task_ids": list(sets.train[:1]), "seeds": (0,), "n_random_sequences": 1,
                  "sequence_length": 6}
    try:
        report = check_package(package, **kwargs)
    except EnvCheckError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}, [
            f"environment: {type(exc).__name__}: {exc}"], []
    data = {**report.to_dict(), "summary": report.summary()}
    return data, [], [f"environment: {n}" for n in report.notes]


def _verifier_part(package: EnvPackage, mode: CheckMode) -> tuple[dict[str, Any] | None,
                                                                   list[str], list[str]]:
    from closedloop.contracts.package import TaskSetRequest

    if package.fixtures is None:
        return None, [], [f"verifier: package {package.env_id!r} ships no adjudicated fixtures: "
                          "its verifier's FP/FN rates are not measured"]
    task_ids = None
    if mode == "quick":
        task_ids = tuple(package.task_sets(TaskSetRequest(1, 1, 0)).train[:1])
    audit = audit_verifier(package.fixtures(task_ids), package.verifier())
    problems = verifier_audit_problems(audit, strict=mode == "quick")
    data = {**audit.to_dict(), "summary": audit.summary(), "fp_upper_bound": FP_UPPER_BOUND,
            "fn_upper_bound": FN_UPPER_BOUND, "rule": "no disagreement" if mode == "quick"
            else "preregistered interval bounds"}
    data["by_family"] = {k: dataclasses.asdict(v) for k, v in audit.by_family.items()}
    return data, [f"verifier: {p}" for p in problems], []


def check_environment_package(package: EnvPackage, mode: CheckMode = "full") -> PackageCheck:
    """Run the environment checker and the verifier audit on ``package`` (module docstring).
    A programming error of the package (an exception that is no declared failure) propagates."""
    if mode == "off":
        return PackageCheck(package.env_id, package.env_version, mode, None, None, (),
                            ("the package check is off (training.package_check: off)",))
    env, env_problems, env_notes = _environment_part(package, mode)
    ver, ver_problems, ver_notes = _verifier_part(package, mode)
    return PackageCheck(package.env_id, package.env_version, mode, env, ver,
                        tuple(env_problems + ver_problems), tuple(env_notes + ver_notes))


def check_before_training(package: EnvPackage, mode: CheckMode,
                          run_dir: Path) -> PackageCheck | None:
    """The check a run's first launch runs before anything is written: ``None`` when the run
    directory already recorded one (``PACKAGE_CHECK_FILE``: a relaunch, or an experiment arm
    given its cold start's), else the check; ``PackageCheckError`` listing the problems when it
    fails. The caller records a returned check with ``record_check`` once the run directory is
    opened."""
    if (run_dir / PACKAGE_CHECK_FILE).is_file():
        return None
    check = check_environment_package(package, mode)
    if not check.passed:
        raise PackageCheckError(package.env_id, list(check.problems))
    return check


def record_check(check: PackageCheck, run_dir: Path) -> Path:
    """Write ``check`` as the run directory's ``PACKAGE_CHECK_FILE``."""
    path = run_dir / PACKAGE_CHECK_FILE
    path.write_text(json.dumps(check.to_dict(), indent=2, sort_keys=True, default=str) + "\n",
                    encoding="utf-8")
    return path
