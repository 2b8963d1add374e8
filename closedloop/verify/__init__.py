"""Clean-room verification: reward vectors, tamper detection, validation and the FP/FN audit.

The verifier reads exported state bytes and the hidden grader, never the agent's workspace
processes or its own claims. See ``closedloop.verify.verifier`` for the reward vector and
``closedloop.contracts.verification`` for the protocol every verifier satisfies.
"""

from closedloop.errors import FixtureError, UnknownGraderError
from closedloop.verify.audit import FamilyCounts, VerifierAudit, audit_verifier
from closedloop.verify.fixtures import AdjudicatedFixture, build_fixtures, independent_label
from closedloop.verify.graders import GradeResult, grade
from closedloop.verify.verifier import (
    REWARD_KEYS,
    VERIFIER_VERSION,
    TaskValidation,
    ValidationReport,
    Verifier,
    check_solvable,
    detect_tamper,
    replay_actions,
)

__all__ = [
    "REWARD_KEYS", "VERIFIER_VERSION", "AdjudicatedFixture", "FamilyCounts", "FixtureError",
    "GradeResult", "TaskValidation", "UnknownGraderError", "ValidationReport", "Verifier",
    "VerifierAudit", "audit_verifier", "build_fixtures", "check_solvable", "detect_tamper",
    "grade", "independent_label", "replay_actions",
]
