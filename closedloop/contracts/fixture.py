"""The adjudicated fixture: a final state with a correctness label, for the verifier's FP/FN audit.

Environment packages build them (``EnvPackage.fixtures``), ``closedloop.envs.verifier_audit`` scores
them; the label is adjudicated where the fixture is built (a hand label an independent checker
confirms).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdjudicatedFixture:
    """A final state and its adjudicated label.

    label: the artifact is a correct solution (hand label, confirmed by the independent checker).
    expect_quarantine: the state holds tampering; the verifier must quarantine it.
    """

    fixture_id: str
    task_id: str
    family: str
    kind: str
    final_state: bytes
    label: bool
    expect_quarantine: bool
    rationale: str
