"""One verifier audit per fixture set and verifier, shared by the suite's gate evaluations.

The ``verifier_fp_fn`` gate re-grades its package's adjudicated fixtures with the package's
verifier on every evaluation (``closedloop.evaluate.gates.environment``); for the terminal
tasks that is about 170 fixtures, a few hundred sandboxed programs, some 12 s of CPU, and the
suite evaluates the gates of a terminal-task run a dozen times. The audit is a function of
the fixtures and the verifier alone, so :func:`install` lets the gate module's
``audit_verifier`` compute it once per process for each (verifier class, verifier version,
fixtures' ids, final-state bytes, labels) and hand the same ``VerifierAudit`` back after.
Everything else the gate checks (the run's own verifier versions, the bounds) is evaluated
each time.

A test that changes a verifier's code in place (``monkeypatch`` of a grader) is marked
``fresh_verifier_audit``: ``tests.conftest`` restores the real function for it. The kill
tests' zygote (``tests.forked_launch``) installs the memo and audits the terminal tasks once
before it forks, so its launches inherit the result.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from closedloop.contracts.fixture import AdjudicatedFixture
from closedloop.envs.verifier_audit import VerifierAudit, audit_verifier
from closedloop.evaluate.gates import environment

_MEMO: dict[tuple[Any, ...], VerifierAudit] = {}


def _key(fixtures: Sequence[AdjudicatedFixture], verifier: Any) -> tuple[Any, ...]:
    return (type(verifier).__module__, type(verifier).__qualname__,
            getattr(verifier, "verifier_version", None),
            tuple((f.fixture_id, f.label, f.expect_quarantine,
                   hashlib.sha256(f.final_state).hexdigest()) for f in fixtures))


def shared_audit(fixtures: Sequence[AdjudicatedFixture], verifier: Any) -> VerifierAudit:
    """``audit_verifier(fixtures, verifier)``, computed once per key (module docstring)."""
    fixtures = list(fixtures)
    key = _key(fixtures, verifier)
    if key not in _MEMO:
        _MEMO[key] = audit_verifier(fixtures, verifier)
    return _MEMO[key]


def install() -> Callable[..., VerifierAudit]:
    """Make the gate module use :func:`shared_audit`; return the function it replaced."""
    original: Callable[..., VerifierAudit] = environment.audit_verifier
    environment.audit_verifier = shared_audit
    return original


def audit_terminal_tasks() -> None:
    """Audit the terminal tasks' default fixtures once (what their runs' gates ask)."""
    from closedloop.envs.terminal.package import terminal_package

    package = terminal_package()
    assert package.fixtures is not None
    shared_audit(package.fixtures(None), package.verifier())
