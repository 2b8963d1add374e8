"""The null gate on every suite (closedloop.evaluate.claim, gate shuffled_reward_control): a
shuffled-reward arm whose lower bound is above 0 on the held-out, the family-disjoint or a
retain suite fails it; a suite the RL arm was evaluated on but the null was not leaves it not
measured; the claim is led by RL − shuffled with RL − frozen beside it, on every suite.
Synthetic experiment directories (tests/evaluate/synthetic_run.py) keep it cheap."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from closedloop.envs.terminal.package import terminal_package
from closedloop.evaluate.gates import GateOptions, evaluate_gates
from closedloop.evaluate.report import build_report
from closedloop.evaluate.retain import retain_suite_tasks
from closedloop.policy.registry import PolicyRegistry
from tests.evaluate import synthetic_run as syn
from tests.evaluate.synthetic_run import build_eval_run, clean_experiment, experiment_gates

NULL = "shuffled_reward_control"


def _gate(exp: Path) -> Any:
    (g,) = evaluate_gates(exp, GateOptions(), only=[NULL]).gates
    return g


def _copy(tmp_path: Path) -> Path:
    return Path(shutil.copytree(clean_experiment(), tmp_path / "exp"))


def _eval(arm: Path, label: str, tasks: list[str], succeed: Callable[[str, str], bool]) -> None:
    """Write ``traces/eval-<label>.jsonl`` of the arm's newest version, one attempt per task."""
    (arm / "traces" / f"eval-{label}.jsonl").unlink(missing_ok=True)
    reg = PolicyRegistry(arm / "registry")
    manifest = reg.manifest(reg.versions()[-1])
    syn._eval(arm, label, manifest, tasks, syn.Spec(seeds=(11,)), succeed)


def _never(task: str, key: str) -> bool:
    return False


def _always(task: str, key: str) -> bool:
    return True


def test_the_clean_null_passes_on_its_suite() -> None:
    g = experiment_gates().gate(NULL)
    assert g.passed is True and set(g.evidence["suites"]) == {"heldout"}
    assert g.evidence["suites"]["heldout"]["estimate"] == 0.0 and g.evidence["baseline"] == "frozen"


def test_a_null_that_gains_on_the_heldout_suite_fails(tmp_path: Path) -> None:
    exp = _copy(tmp_path)
    shutil.rmtree(exp / "arms" / "shuffled")
    build_eval_run(exp / "arms" / "shuffled", _never, _always)
    g = _gate(exp)
    assert g.passed is False and g.evidence["suites"]["heldout"]["ci"][0] > 0
    assert "heldout: shuffled rewards gained" in g.detail


def test_a_null_that_gains_only_on_the_family_suite_fails(tmp_path: Path) -> None:
    exp = _copy(tmp_path)
    family = syn.tasks("heldout", 4)
    _eval(exp / "arms" / "frozen", "start-family", family, _never)
    _eval(exp / "arms" / "rloo", "final-family", family, _always)
    _eval(exp / "arms" / "shuffled", "final-family", family, _never)
    assert _gate(exp).passed is True  # heldout and family: no stable gain
    _eval(exp / "arms" / "shuffled", "final-family", family, _always)
    g = _gate(exp)
    assert g.passed is False and "family: shuffled rewards gained +1.000" in g.detail
    assert g.evidence["suites"]["heldout"]["ci"][0] <= 0  # the held-out suite alone passes


def test_a_null_that_gains_on_a_retain_suite_fails(tmp_path: Path) -> None:
    exp = _copy(tmp_path)
    safety = list(retain_suite_tasks(terminal_package(), ["safety"])["safety"])[:4]
    _eval(exp / "arms" / "frozen", "retain-start", safety, _never)
    _eval(exp / "arms" / "rloo", "retain-final", safety, _never)
    g = _gate(exp)  # the RL arm has the retain suite, the null does not: not measured
    assert g.passed is None and "retain:safety" in g.detail
    _eval(exp / "arms" / "shuffled", "retain-final", safety, _always)
    g = _gate(exp)
    assert g.passed is False and "retain:safety: shuffled rewards gained" in g.detail
    report = build_report(exp)
    row = report["claim_by_suite"]["retain:safety"]
    assert row["rl_minus_null"]["estimate"] == -1.0 and row["null_minus_frozen"]["ci"][0] > 0
    assert report["diagnostics"]["arms"]["retain:safety"]["shuffled"]["episodes"] == 4


def test_a_suite_the_null_missed_leaves_the_gate_not_measured(tmp_path: Path) -> None:
    exp = _copy(tmp_path)
    family = syn.tasks("heldout", 4)
    _eval(exp / "arms" / "frozen", "start-family", family, _never)
    _eval(exp / "arms" / "rloo", "final-family", family, _always)
    g = _gate(exp)
    assert g.passed is None and "family" in g.detail and g.evidence["not_measured"]


@pytest.mark.parametrize("gains", [False, True])
def test_the_claim_is_led_by_the_reward_share(tmp_path: Path, gains: bool) -> None:
    exp = _copy(tmp_path)
    if gains:  # the null gains as much as RL: RL - shuffled is 0, no gain is the reward's
        shutil.rmtree(exp / "arms" / "shuffled")
        build_eval_run(exp / "arms" / "shuffled", syn.half_success, lambda t, k: True)
    report = build_report(exp)
    claim = report["claim"]
    assert claim["comparison"].startswith("RL final - shuffled final")
    assert claim["beside"]["estimate"] == 0.5  # RL - frozen, beside the headline
    if gains:
        assert claim["gain"] is None and NULL in claim["failed_gates"]
    else:
        assert claim["gain"] is True and "the reward's share" in claim["statement"]


def test_the_cli_prints_the_three_comparisons_by_suite(tmp_path: Path) -> None:
    from closedloop.cli.text import report_lines
    from closedloop.evaluate.report import write_report

    _, json_path = write_report(clean_experiment(), gates=experiment_gates(), out_dir=tmp_path)
    lines = report_lines(json_path)
    head = lines.index("== what the reward caused, by suite: RL - shuffled (the reward's share) "
                       "| RL - frozen | shuffled - frozen (the null) ==")
    assert lines[head + 1].split() == ["held-out,", "template-disjoint", "+0.500", "[+0.500,",
                                       "+0.500]", "|", "+0.500", "[+0.500,", "+0.500]", "|",
                                       "+0.000", "[+0.000,", "+0.000]"]
    assert lines[-1].startswith("claim: Capability gain: held-out success RL final - shuffled")


def test_a_suite_where_every_attempt_of_both_arms_failed_is_untested_not_passed(
        tmp_path: Path) -> None:
    """The null cannot show a gain where every attempt of the null and of its baseline
    failed: such a suite is listed without signal, never among the suites it passed on, and
    the claim's rows for it say not measured."""
    exp = _copy(tmp_path)
    family = syn.tasks("heldout", 4)
    _eval(exp / "arms" / "frozen", "start-family", family, _never)
    _eval(exp / "arms" / "rloo", "final-family", family, _never)
    _eval(exp / "arms" / "shuffled", "final-family", family, _never)
    g = _gate(exp)
    row = g.evidence["suites"]["family"]
    assert not row["measured"] and row["no_signal"] == "failed"
    assert g.evidence["without_signal"] and "family" in g.evidence["without_signal"][0]
    assert g.passed is True and "no stable gain on 1 suites: heldout" in g.detail
    assert "without signal, so untested: family" in g.detail
    claim = build_report(exp, evaluate_gates(exp))["claim_by_suite"]["family"]
    assert all(not claim[k]["measured"] and claim[k]["no_signal"] == "failed"
               for k in ("rl_minus_null", "rl_minus_frozen", "null_minus_frozen"))
