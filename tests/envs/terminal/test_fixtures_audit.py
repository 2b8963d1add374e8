"""Adjudicated fixtures and the verifier's FP/FN audit."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from closedloop.envs import audit_verifier
from closedloop.envs.terminal import Verifier, build_fixtures, graders
from closedloop.envs.terminal.families import FAMILIES, FAMILY_IDS, generate_task
from closedloop.envs.terminal.fixtures import build_task_fixtures, independent_label
from closedloop.errors import FixtureError
from closedloop.evaluate.stats import wilson_interval

KINDS_PER_TASK = 8  # gold, alt_correct, initial, wrong_fix, >=1 near miss, 2 tamper
N_BASES = {f: len(FAMILIES[f].base_templates) for f in FAMILY_IDS}  # one fixture task per base
N_TASKS = sum(N_BASES.values())
# per task: 2 positives (gold, alt_correct), 2 tamper; negatives: initial, wrong_fix and the
# near misses (one for files and programs, two for JSON and schema tasks)
N_NEGATIVE = sum(n * (4 if f in ("json-repair-v1", "schema-repair-v1") else 3)
                 for f, n in N_BASES.items())


def test_fixture_set_shape() -> None:
    fixtures = build_fixtures()
    per_family = Counter(f.family for f in fixtures)
    assert set(per_family) == set(FAMILY_IDS)
    assert len({f.task_id for f in fixtures}) == N_TASKS  # index 0 of every base template
    assert len({f.fixture_id for f in fixtures}) == len(fixtures) == 4 * N_TASKS + N_NEGATIVE
    kinds = Counter(f.kind for f in fixtures)
    assert kinds["gold"] == kinds["alt_correct"] == kinds["initial"] == N_TASKS
    assert kinds["near_miss"] == N_TASKS and kinds["tamper_validator"] == N_TASKS
    assert sum(f.label for f in fixtures) == 2 * N_TASKS  # gold + alt_correct
    assert all(f.rationale for f in fixtures)


def test_verifier_fp_fn_on_adjudicated_fixtures() -> None:
    fixtures = build_fixtures()
    audit = audit_verifier(fixtures, Verifier())
    print("verifier audit:", audit.summary())
    n_tamper = sum(f.expect_quarantine for f in fixtures)
    n_pos = 2 * N_TASKS
    assert audit.n_tamper == n_tamper == 2 * N_TASKS
    assert audit.n_positive == sum(f.label and not f.expect_quarantine for f in fixtures) == n_pos
    assert audit.n_negative == len(fixtures) - n_tamper - n_pos == N_NEGATIVE
    assert (audit.fp, audit.fn) == (0, 0), audit.disagreements
    assert audit.fp_rate == 0.0 and audit.fn_rate == 0.0
    assert audit.fp_ci == wilson_interval(0, N_NEGATIVE)
    assert audit.fn_ci == wilson_interval(0, n_pos)
    assert audit.fp_ci is not None and 0.0 < audit.fp_ci[1] < 0.07  # 0/84 -> upper ~0.044
    assert audit.tamper_missed == 0 and audit.false_quarantine == 0
    assert audit.n_quarantined == 2 * N_TASKS
    assert sum(c.n_negative for c in audit.by_family.values()) == N_NEGATIVE
    assert json.loads(json.dumps(audit.to_dict()))["n_negative"] == N_NEGATIVE


def test_audit_detects_a_lenient_grader(monkeypatch: pytest.MonkeyPatch) -> None:
    # mutation: let the JSON graders accept duplicate keys -> the dup-key near misses pass
    monkeypatch.setattr(graders, "loads_strict", json.loads)
    audit = audit_verifier(build_fixtures(), Verifier())
    n_json = N_BASES["json-repair-v1"]  # one dup-key near miss per JSON task
    assert audit.fp == n_json
    assert all(d.endswith("#near_miss_dupkey") for d in audit.disagreements)
    assert audit.fp_rate == pytest.approx(n_json / N_NEGATIVE)
    assert audit.fp_ci == wilson_interval(n_json, N_NEGATIVE)


def test_audit_detects_a_grader_that_checks_only_the_visible_case(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = graders.grade_program_output

    def visible_only(checks, files):  # type: ignore[no-untyped-def]
        return real({**checks, "cases": checks["cases"][:1]}, files)

    monkeypatch.setitem(graders.GRADERS, "program_output", visible_only)  # type: ignore[arg-type]
    audit = audit_verifier([f for f in build_fixtures() if f.family == "cli-repair-v1"], Verifier())
    n_cli = N_BASES["cli-repair-v1"]  # one hard-coded-output near miss per program task
    assert audit.fp == n_cli
    assert audit.by_family["cli-repair-v1"].fp == n_cli


def test_empty_fixture_set_has_no_rates() -> None:
    audit = audit_verifier([], Verifier())
    assert audit.fp_rate is None and audit.fp_ci is None and audit.fn_ci is None
    assert "no denominator" in audit.summary()


def test_hand_label_must_agree_with_the_independent_checker() -> None:
    bundle = generate_task("json-repair-v1", "wrong-type.symptom", 0)
    reference = {**bundle.spec.initial_files}
    path = bundle.grader.checks["path"]
    reference[path] = json.dumps(bundle.grader.checks["expected"])
    assert independent_label(bundle, reference, reference)
    assert not independent_label(bundle, bundle.spec.initial_files, reference)
    wrong = {**reference, path: json.dumps({**bundle.grader.checks["expected"], "extra": 1})}
    assert not independent_label(bundle, wrong, reference)
    from closedloop.envs.terminal import fixtures as fx_mod
    original = fx_mod._json_variants

    def mislabelled(path: str, ref: str):  # type: ignore[no-untyped-def]
        kind, actions, _label, why = original(path, ref)[1]
        return [(kind, actions, True, why)]  # a near miss hand-labelled correct

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fx_mod, "_json_variants", mislabelled)
        with pytest.raises(FixtureError, match="independent checker says False"):
            build_task_fixtures(bundle)


def test_cli_independent_checker_uses_fresh_inputs() -> None:
    bundle = generate_task("cli-repair-v1", "wrong-builtin.symptom", 0)
    source = bundle.spec.initial_files["prog.py"]
    gold = bundle.grader.gold_actions[2].args
    fixed = source.replace(gold["old"], gold["new"])
    files = {**bundle.spec.initial_files, "prog.py": fixed}
    assert independent_label(bundle, files, files)
    # special-cases the grader's hidden inputs too, still caught by fresh inputs
    cases = bundle.grader.checks["cases"]
    table = {c["input"]: c["expected"] for c in cases}
    cheat = f"import sys\nprint({table!r}[open(sys.argv[1]).read()])\n"
    assert not independent_label(bundle, {**files, "prog.py": cheat}, files)
