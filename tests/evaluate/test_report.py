"""The core report: numbers recomputed from the run, the capability-claim rule, the HTML page
(rendered in headless Chromium when available) and ``closedloop report``."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from matplotlib.image import imread

from closedloop.cli import main
from closedloop.cli.text import report_lines
from closedloop.envs.terminal import build_fixtures
from closedloop.evaluate import gates as gates_pkg
from closedloop.evaluate.gates import GATE_NAMES, Gate, GateReport
from closedloop.evaluate.report import build_report, capability_claim, render_html, write_report
from closedloop.evaluate.stats import wilson_interval
from tests.evaluate.synthetic_run import (
    clean_experiment,
    clean_gates,
    clean_run,
    copy_run,
    experiment_gates,
)


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    return build_report(clean_run(), gates=clean_gates())


def test_heldout_numbers_are_what_the_traces_say(report: dict[str, Any]) -> None:
    # start: per task seed 11 succeeds, seed 22 fails -> c=1 of n=2; final: both succeed.
    start, final = report["heldout"]["start"], report["heldout"]["final"]
    assert (start["pass_at_1"], final["pass_at_1"]) == (0.5, 1.0)
    assert (start["k"], start["pass_hat_k"], start["pass_at_k"]) == (2, 0.0, 1.0)  # C(1,2)/C(2,2)
    assert final["pass_hat_k"] == 1.0 and final["tasks_scored"] == 4
    assert (start["policy_version"], final["policy_version"]) == ("v0000", "v0002")
    diff = report["heldout"]["final_minus_start"]
    assert diff["measured"] and diff["estimate"] == 0.5 and diff["ci"] == [0.5, 0.5]
    assert diff["tasks"] == 4
    assert start["invalid_action_rate"] == 0.0 and start["side_effect_rate"] == 0.0
    assert start["termination"] == {"agent_finish": 8}


def test_training_diagnostics(report: dict[str, Any]) -> None:
    tr = report["training"]
    assert [s["step"] for s in tr["steps"]] == [0, 1]
    assert [s["estimator"] for s in tr["steps"]] == ["rloo", "rloo"]  # which one made each update
    assert "<td>rloo</td>" in render_html(report)
    # every step group has one success (sibling 0) and one failure: no zero-advantage group
    assert tr["zero_advantage_groups"] == {"zero_variance": 0, "admitted_groups": 4, "rate": 0.0}
    assert all(s["train_success"] == 0.5 for s in tr["steps"])
    assert all(s["losses/kl"] is not None and s["optim/grad_norm"] > 0 for s in tr["steps"])
    curves = tr["learning_curves"]
    assert curves["interactions"][1] > curves["interactions"][0] > 0
    assert curves["action_tokens"][1] > curves["action_tokens"][0] > 0
    mass = tr["gradient_mass_share"]
    assert mass["success"] + mass["failure"] == pytest.approx(1.0)
    assert mass["short"] + mass["medium"] + mass["long"] == pytest.approx(1.0)
    assert report["termination"]["train"] == {"agent_finish": 8}
    assert report["ledger"]["consumed"] == 4 and report["ledger"]["rejection_fraction"] is None


def test_verifier_section_has_denominators_and_wilson_intervals(report: dict[str, Any]) -> None:
    v = report["verifier"]
    fixtures = build_fixtures()  # the terminal tasks' default set (memoized)
    n_pos = sum(f.label and not f.expect_quarantine for f in fixtures)
    n_neg = sum(not f.label and not f.expect_quarantine for f in fixtures)
    assert (n_neg, n_pos) == (84, 48)  # 24 fixture tasks (one per base template)
    assert (v["fp"], v["n_negative"], v["fn"], v["n_positive"]) == (0, n_neg, 0, n_pos)
    assert tuple(v["fp_ci"]) == wilson_interval(0, n_neg)
    assert tuple(v["fn_ci"]) == wilson_interval(0, n_pos)
    assert v["status"] == "PASS"


def test_no_gain_is_claimed_while_gates_are_not_measured(report: dict[str, Any]) -> None:
    claim = report["claim"]
    assert claim["gain"] is None and not claim["all_gates_passed"]
    assert set(claim["not_measured_gates"]) == {"train_inference_mismatch",
                                                "shuffled_reward_control"}
    assert "not measured" in claim["statement"] and "No gain is claimed" in claim["statement"]
    json.dumps(report, allow_nan=False)  # strict JSON


def _gates(passed: bool | None) -> GateReport:
    return GateReport("run", (Gate("a", True, {}, ""), Gate("b", passed, {}, "")))


@pytest.mark.parametrize(("passed", "ci", "gain", "words"), [
    (True, [0.1, 0.3], True, "Capability gain"),
    (True, [-0.1, 0.3], False, "includes 0"),
    (True, [-0.3, -0.1], False, "decreased"),
    (False, [0.1, 0.3], None, "gates failed: b"),
    (None, [0.1, 0.3], None, "gates not measured: b"),
])
def test_capability_claim_rule(passed: bool | None, ci: list[float], gain: bool | None,
                               words: str) -> None:
    comparison = {"what": "final - start", "measured": True, "estimate": sum(ci) / 2,
                  "ci": ci, "tasks": 16}
    claim = capability_claim(_gates(passed), comparison)
    assert claim["gain"] is gain and words in claim["statement"]


def test_a_claim_whose_interval_includes_0_states_what_it_cannot_resolve() -> None:
    comparison = {"what": "final - start", "measured": True, "estimate": -0.021,
                  "ci": [-0.125, 0.104], "tasks": 16}
    claim = capability_claim(_gates(True), comparison)
    assert claim["gain"] is False and claim["resolution"] == pytest.approx(0.1145)
    assert "none is ruled out" in claim["statement"]
    assert "smaller than about 0.11" in claim["statement"]
    resolved = capability_claim(_gates(True), {**comparison, "ci": [0.02, 0.2]})
    assert "resolution" not in resolved  # a stated gain, or a decrease, needs no such caveat


def test_claim_needs_a_measured_comparison() -> None:
    claim = capability_claim(_gates(True), {"what": "final - start", "measured": False,
                                            "detail": "1 tasks scored in both evaluations"})
    assert claim["gain"] is None and "1 tasks scored" in claim["statement"]


@pytest.fixture(scope="module")
def experiment_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("report")
    return write_report(clean_experiment(), gates=experiment_gates(), out_dir=out)


def test_experiment_report_states_gain_only_with_all_gates_and_ci(
        experiment_report: tuple[Path, Path]) -> None:
    data = json.loads(experiment_report[1].read_text())
    assert data["gates"]["all_passed"] is True
    arms = data["arms"]
    assert set(arms) == {"frozen", "rloo", "shuffled", "sft_only"}
    assert arms["frozen"]["evaluation"] == "start" and "vs_frozen" not in arms["frozen"]
    assert arms["shuffled"]["vs_frozen"]["estimate"] == 0.0
    assert arms["sft_only"]["vs_frozen"]["ci"] == [0.0, 0.0]
    assert arms["rloo"]["vs_frozen"]["ci"] == [0.5, 0.5]
    assert arms["shuffled"]["rl_minus_null"]["what"] == "RL final - shuffled final"
    assert arms["shuffled"]["rl_minus_null"]["estimate"] == 0.5
    assert all("rl_minus_null" not in arms[n] for n in ("frozen", "rloo", "sft_only"))
    claim = data["claim"]  # led by the reward's share, RL - frozen beside it
    assert claim["gain"] is True
    assert claim["comparison"] == "RL final - shuffled final (held-out, template-disjoint)"
    assert claim["beside"]["what"] == "RL final - frozen (held-out, template-disjoint)"
    assert "the reward's share; beside it, RL final - frozen" in claim["statement"]
    by_suite = data["claim_by_suite"]["heldout"]
    assert by_suite["rl_minus_null"]["ci"] == [0.5, 0.5]
    assert by_suite["rl_minus_frozen"]["ci"] == [0.5, 0.5]
    assert by_suite["null_minus_frozen"]["estimate"] == 0.0
    diag = data["diagnostics"]["arms"]["heldout"]
    assert set(diag) == {"frozen", "rl", "shuffled"}
    assert diag["rl"]["episodes"] == 8 and diag["rl"]["turns_per_episode"] > 0
    updates = data["diagnostics"]["updates"]
    assert [u["step"] for u in updates] == [0, 1] and all(u["passes"] == [] for u in updates)


@pytest.mark.parametrize(("suite", "key", "title"), [
    ("family", "family_disjoint", "family-disjoint"),
    ("train", "in_distribution", "train tasks, in distribution")])
def test_each_other_suite_reports_the_shuffled_control_beside_the_rl_arm(
        tmp_path: Path, suite: str, key: str, title: str) -> None:
    exp = Path(shutil.copytree(clean_experiment(), tmp_path / "exp"))
    arms = exp / "arms"
    gates = experiment_gates()  # the suites below never enter a gate: evaluated once
    before = build_report(arms / "rloo", gates)[key]  # no final evaluation on the suite yet
    assert before.get("comparison", before)["measured"] is False
    assert before.get("comparison", before)["what"] == f"RL final - frozen start ({title})"
    shutil.copy(arms / "frozen" / "traces" / "eval-start.jsonl",
                arms / "frozen" / "traces" / f"eval-start-{suite}.jsonl")
    shutil.copy(arms / "rloo" / "traces" / "eval-final.jsonl",
                arms / "rloo" / "traces" / f"eval-final-{suite}.jsonl")
    report = build_report(exp / "arms" / "rloo", gates)
    other = report[key]
    assert other["comparison"]["measured"] and other["comparison"]["estimate"] == 0.5
    assert other["control"] == {"measured": False, "what": "shuffled-reward control",
                                "detail": "the shuffled arm was not evaluated on this suite"}
    shutil.copy(arms / "shuffled" / "traces" / "eval-final.jsonl",
                arms / "shuffled" / "traces" / f"eval-final-{suite}.jsonl")
    report = build_report(exp / "arms" / "rloo", gates)
    control = report[key]["control"]
    assert control["measured"] and control["estimate"] == 0.0
    assert control["what"] == f"shuffled final - frozen start ({title})"
    table_id = "family-table" if suite == "family" else "train-table"
    table = render_html(report).split(f'id="{table_id}"')[1].split("</table>")[0]
    assert f"shuffled final - frozen start ({title})" in table
    attribution = report[key]["rl_minus_null"]  # the reward's share: RL against its null
    assert attribution["what"] == f"RL final - shuffled final ({title})"
    assert attribution["estimate"] == 0.5 and attribution["ci"] == [0.5, 0.5]
    printed = "\n".join(report_lines(write_report(arms / "rloo", gates)[1]))
    assert f"RL final - frozen start ({title}) = +0.500" in printed
    assert f"shuffled final - frozen start ({title}) = +0.000" in printed
    assert f"RL final - shuffled final ({title}) = +0.500 [+0.500, +0.500]" in printed
    assert ("held-out, RL against its null: RL final - shuffled final = +0.500 "
            "[+0.500, +0.500]") in printed


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def test_report_html_is_self_contained_and_renders_in_chromium(
        experiment_report: tuple[Path, Path], tmp_path: Path) -> None:
    text = experiment_report[0].read_text()
    images = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text)
    assert {alt for alt, _ in images} >= {"held-out success", "training diagnostics",
                                          "gradient mass", "learning curves",
                                          "termination distribution"}
    assert all(base64.b64decode(b64)[:8] == b"\x89PNG\r\n\x1a\n" for _, b64 in images)
    assert not re.search(r'(src|href)="(https?:|//)', text)  # nothing fetched from outside
    table = text[text.index('id="gates-table"'):].split("</table>")[0]
    # every gate a row (plus the header), every one PASS but async_equals_sync (N/A)
    assert table.count("<tr>") == len(GATE_NAMES) + 1
    assert table.count(">PASS<") == len(GATE_NAMES) - 1
    for column in ("rloo final", "shuffled final", "sft_only final", "frozen start"):
        assert f"<th>{column}</th>" in text
    assert "<td>RL final - shuffled final</td>" in text  # the held-out attribution row
    chromium = shutil.which("chromium")
    if chromium is None:
        if _in_ci():
            pytest.fail("CI=true but chromium is not installed (apt-get install -y chromium)")
        pytest.skip("chromium not installed (apt-get install -y chromium); outside CI")
    shot = tmp_path / "report.png"
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                        "--disable-quic", "--no-first-run", "--disable-background-networking",
                        "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={profile}", f"--screenshot={shot}",
                        "--window-size=1200,3000", experiment_report[0].resolve().as_uri()],
                       check=True, capture_output=True, timeout=120)
    pixels = imread(shot)
    assert pixels.shape[:2] == (3000, 1200)
    gray = pixels[..., :3].mean(axis=-1)
    assert (gray < 0.5).mean() > 0.01  # text and plot lines were drawn, not a blank page
    colors = np.unique((pixels[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colors) > 50  # plots (bars, anti-aliased lines), not a single colour


def test_cli_report_writes_both_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    subset = tuple((n, f) for n, f in gates_pkg.GATES if n == "termination_codes")
    monkeypatch.setattr(gates_pkg, "GATES", subset)
    run = copy_run(tmp_path / "run")
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"report: {run / 'report.html'}" in out
    data = json.loads((run / "report.json").read_text())
    assert data["schema"] == "closedloop-report-v1"
    assert [g["name"] for g in data["gates"]["gates"]] == ["termination_codes"]
    # one gate evaluated and passed: a partial gate report never supports a claim
    assert data["claim"]["gain"] is None and "not evaluated" in data["claim"]["statement"]
