"""Verifier FP/FN audit on adjudicated fixtures (the verifier FP/FN go/no-go gate), for any
environment package's verifier.

Each fixture is a final state with an adjudicated label (correct or not) from an independent,
stronger checker (the package's ``fixtures``; the terminal tasks': ``closedloop.envs.terminal.
fixtures``). The verifier's decision is ``task_success``;
a quarantined fixture (reward ``None``) counts as *rejected* for FP/FN purposes and is also
counted on its own:

- FP: label incorrect, verifier accepts (the dangerous error: it reinforces a wrong artifact);
- FN: label correct, verifier rejects (wasted experience, a more conservative policy).

Rates are FP / negatives and FN / positives with Wilson 95% intervals
(``closedloop.intervals.wilson_interval``); a rate with no denominator is ``None``, never 0.
Tamper fixtures (``expect_quarantine``) are left out of FP/FN: they must be quarantined, and
``tamper_missed`` counts those that were not (``n_tamper`` is its denominator);
``false_quarantine`` counts the other fixtures that were quarantined.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from closedloop.contracts import TaskVerifier
from closedloop.contracts.fixture import AdjudicatedFixture
from closedloop.intervals import wilson_interval


@dataclass(frozen=True)
class FamilyCounts:
    """Per-family FP/FN counts with their denominators."""

    fp: int
    n_negative: int
    fn: int
    n_positive: int


@dataclass(frozen=True)
class VerifierAudit:
    """FP/FN counts, denominators, rates and Wilson 95% intervals of one verifier version.

    disagreements: fixture ids where the verifier's decision differs from the label.
    """

    fp: int
    fn: int
    n_negative: int
    n_positive: int
    fp_rate: float | None
    fn_rate: float | None
    fp_ci: tuple[float, float] | None
    fn_ci: tuple[float, float] | None
    n_quarantined: int
    n_tamper: int
    tamper_missed: int
    false_quarantine: int
    by_family: Mapping[str, FamilyCounts]
    disagreements: tuple[str, ...]
    verifier_version: str

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (for ``report.json``)."""
        return dataclasses.asdict(self)

    def summary(self) -> str:
        """A one-line human summary with denominators and intervals."""
        def part(name: str, k: int, n: int, ci: tuple[float, float] | None) -> str:
            if ci is None:
                return f"{name} {k}/{n} (no denominator)"
            return f"{name} {k}/{n} = {k / n:.3f} [95% CI {ci[0]:.3f}, {ci[1]:.3f}]"
        return (f"{part('FP', self.fp, self.n_negative, self.fp_ci)}; "
                f"{part('FN', self.fn, self.n_positive, self.fn_ci)}; "
                f"quarantined {self.n_quarantined}; tamper missed {self.tamper_missed}/"
                f"{self.n_tamper}; false quarantine {self.false_quarantine}; "
                f"{self.verifier_version}")


def _rate(k: int, n: int) -> tuple[float | None, tuple[float, float] | None]:
    if n == 0:
        return None, None
    return k / n, wilson_interval(k, n)


def audit_verifier(fixtures: Sequence[AdjudicatedFixture],
                   verifier: TaskVerifier) -> VerifierAudit:
    """Score every fixture with ``verifier`` and count FP/FN against the adjudicated labels."""
    v = verifier
    fp = fn = n_neg = n_pos = n_quar = n_tamper = tamper_missed = false_quar = 0
    fam: dict[str, list[int]] = {}
    disagreements: list[str] = []
    for fx in fixtures:
        result = v.score_or_quarantine(fx.task_id, fx.final_state)
        quarantined = result.reward is None
        accepted = result.reward is not None and result.reward["task_success"] == 1.0
        n_quar += quarantined
        if fx.expect_quarantine:
            n_tamper += 1
            tamper_missed += not quarantined
            continue
        false_quar += quarantined
        counts = fam.setdefault(fx.family, [0, 0, 0, 0])
        if fx.label:
            n_pos += 1
            counts[3] += 1
            if not accepted:
                fn += 1
                counts[2] += 1
                disagreements.append(fx.fixture_id)
        else:
            n_neg += 1
            counts[1] += 1
            if accepted:
                fp += 1
                counts[0] += 1
                disagreements.append(fx.fixture_id)
    fp_rate, fp_ci = _rate(fp, n_neg)
    fn_rate, fn_ci = _rate(fn, n_pos)
    return VerifierAudit(
        fp=fp, fn=fn, n_negative=n_neg, n_positive=n_pos, fp_rate=fp_rate, fn_rate=fn_rate,
        fp_ci=fp_ci, fn_ci=fn_ci, n_quarantined=n_quar, n_tamper=n_tamper,
        tamper_missed=tamper_missed, false_quarantine=false_quar,
        by_family={k: FamilyCounts(*c) for k, c in sorted(fam.items())},
        disagreements=tuple(disagreements), verifier_version=v.verifier_version)
