"""The held-out overlap gate (closedloop.evaluate.gates.overlap) on synthetic run directories: a
held-out task that duplicates or near-duplicates a train task fails it, so does an audit under
another rule version than the config names; a package without an overlap rule leaves it N/A; the
config refuses a rule version the package does not implement; the report shows the audit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from closedloop.config import parse_config
from closedloop.contracts import ConfigError
from closedloop.envs.terminal.families.overlap import DEDUP_RULE_VERSION, audit_overlap
from closedloop.envs.terminal.families.registry import get_bundle
from closedloop.evaluate.gates import GateOptions, evaluate_gates
from closedloop.evaluate.report import build_report, render_html
from tests.evaluate.synthetic_run import clean_gates, clean_run, copy_run


def gate(run: Path) -> Any:
    (g,) = evaluate_gates(run, GateOptions(), only=["heldout_overlap"]).gates
    return g


def _retask(run: Path, heldout: list[str] | None = None, **audit: Any) -> None:
    """Rewrite tasks.json's overlap audit, recomputed over its train and ``heldout`` tasks."""
    tasks = json.loads((run / "tasks.json").read_text())
    if heldout is not None:
        tasks["heldout"] = heldout
    report = audit_overlap([get_bundle(t) for t in tasks["train"]],
                           [get_bundle(t) for t in tasks["heldout"]]).to_dict()
    tasks["overlap"] = {**report, **audit}
    (run / "tasks.json").write_text(json.dumps(tasks))


def test_a_clean_split_passes_with_its_audit_as_evidence() -> None:
    g = clean_gates().gate("heldout_overlap")
    assert g.passed is True and g.evidence["dedup_rule_version"] == DEDUP_RULE_VERSION
    assert g.evidence["n_train"] == 8 and g.evidence["exact_pairs"] == []


def test_a_heldout_task_that_is_a_train_task_fails(tmp_path: Path) -> None:
    run = copy_run(tmp_path / "run")
    tasks = json.loads((run / "tasks.json").read_text())
    _retask(run, heldout=[*tasks["heldout"][:-1], tasks["train"][0]])  # a duplicate
    g = gate(run)
    assert g.passed is False and "held-out tasks duplicate a train task" in g.detail
    assert tasks["train"][0] in g.evidence["exact_pairs"][0]


def test_a_near_duplicate_fails(tmp_path: Path) -> None:
    run = copy_run(tmp_path / "run")
    tasks = json.loads((run / "tasks.json").read_text())
    _retask(run, near_pairs=[{"train_id": tasks["train"][1], "heldout_id": tasks["heldout"][0],
                              "similarity": 0.91}])
    g = gate(run)
    assert g.passed is False and "near-duplicate a train task" in g.detail and "0.91" in g.detail


@pytest.mark.parametrize(("change", "words"), [
    ({"dedup_rule_version": "v1"}, "the config names 'v2'"),
    ({"n_heldout": 99}, "tasks.json holds"),
    ({"shared_templates": ["json-repair-v1/wrong-type"]}, "both trained on and held out"),
])
def test_an_audit_that_proves_nothing_fails(tmp_path: Path, change: dict[str, Any],
                                            words: str) -> None:
    run = copy_run(tmp_path / "run")
    _retask(run, **change)
    g = gate(run)
    assert g.passed is False and words in g.detail


def test_a_missing_audit_fails_closed(tmp_path: Path) -> None:
    run = copy_run(tmp_path / "run")
    tasks = json.loads((run / "tasks.json").read_text())
    del tasks["overlap"]
    (run / "tasks.json").write_text(json.dumps(tasks))
    g = gate(run)
    assert g.passed is False and "holds no overlap audit" in g.detail


def test_the_config_names_the_rule_the_package_implements() -> None:
    assert parse_config({}).evaluation.dedup_rule_version == DEDUP_RULE_VERSION
    with pytest.raises(ConfigError, match=r"evaluation\.dedup_rule_version") as info:
        parse_config({"evaluation": {"dedup_rule_version": "v1"}})
    assert "implements overlap rule 'v2', not 'v1'" in str(info.value)
    lockbox = {"environment": {"id": "lockbox-v1",
                               "factory": "tests.envs.lockbox:lockbox_package"},
               "evaluation": {"retain_suites": [], "environment_family_disjoint": False}}
    parse_config(lockbox)  # no overlap rule: the default is accepted
    with pytest.raises(ConfigError, match="declares no overlap audit"):
        parse_config({**lockbox, "evaluation": {**lockbox["evaluation"],
                                                "dedup_rule_version": "v3"}})


def test_the_report_shows_the_audit() -> None:
    report = build_report(clean_run(), gates=clean_gates())
    overlap = report["overlap"]
    assert overlap["audit"]["dedup_rule_version"] == DEDUP_RULE_VERSION
    assert overlap["gate"]["passed"] is True
    table = render_html(report).split('id="overlap-table"')[1].split("</table>")[0]
    assert "near-duplicate pairs" in table and DEDUP_RULE_VERSION in table
