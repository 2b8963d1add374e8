"""The four-arm experiment run end to end on the tiny agent (the session's ``tiny_experiment``):
every suite the config asks for is evaluated for the arms that answer it, and an arm finished
before a suite was evaluated gets that evaluation on resume, without training again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from closedloop.config import parse_config
from closedloop.contracts.metrics_log import read_metrics
from closedloop.evaluate.report import build_report, render_html
from closedloop.experiments.controls import SUITE_ARMS, run_experiment
from tests.conftest import copy_experiment, experiment_config

pytestmark = pytest.mark.slow


def _run(exp: Path, model: Path) -> dict[str, object]:
    """Run (or resume) the experiment of the session's ``tiny_experiment`` config."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_experiment(parse_config(experiment_config(model)), exp)
    finally:
        torch.set_num_threads(threads)


def _figures(suites: object) -> str:
    """The suites' figures as canonical JSON, without the arms' directories (the experiment
    read here is a copy of the session's)."""
    def strip(x: object) -> object:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k != "run_dir"}
        return [strip(v) for v in x] if isinstance(x, list | tuple) else x

    return json.dumps(strip(suites), sort_keys=True)


def _rl_steps(arm: Path) -> int:
    return sum(1 for r in read_metrics(arm / "metrics.jsonl") if r["kind"] == "rl_step")


def test_the_train_suite_is_compared_for_the_rl_arm_and_its_null_and_filled_in_on_resume(
        tiny_agent_dir: Path, tiny_experiment: Path, tmp_path: Path) -> None:
    exp = copy_experiment(tiny_experiment, tmp_path / "exp")
    result = json.loads((exp / "experiment.json").read_text())  # what run_experiment returned
    suites = result["suites"]
    assert isinstance(suites, dict) and set(suites) == {"heldout", "train"}
    train = suites["train"]
    assert set(train["arms"]) == set(SUITE_ARMS)
    for name in ("rloo", "shuffled"):
        diff = train["arms"][name]["diff_vs_frozen"]
        assert diff["n_tasks"] == train["tasks"] == 2 and diff["lo"] <= diff["estimate"]
        assert (exp / "arms" / name / "traces" / "eval-final-train.jsonl").is_file()
    assert not (exp / "arms" / "sft_only" / "traces" / "eval-final-train.jsonl").exists()
    for suite in suites.values():  # the frozen arm is the baseline, never compared to itself
        assert "diff_vs_frozen" not in suite["arms"]["frozen"]

    # one precision for the whole experiment, the cold start's, in every arm and the report;
    # and the phases of the launch, each timed
    assert result["precision"]["precision"] == "float32"
    for arm in ("frozen", "rloo", "shuffled", "sft_only"):
        meta = json.loads((exp / "arms" / arm / "config.json").read_text())
        assert meta["precision"] == result["precision"]
    phases = [p["phase"] for p in result["phases_this_launch"]]
    assert phases[0] == "cold start (the frozen arm)" and "arm sft_only" in phases
    assert {"eval start", "audit", "rl step 0", "arm rloo", "arm shuffled"} <= set(phases)
    full = build_report(exp / "arms" / "rloo")
    assert full["run"]["precision"]["precision"] == "float32"
    assert "id='precision'>Precision: float32" in render_html(full)
    report = full["in_distribution"]
    assert report["comparison"]["what"] == "RL final - frozen start (train tasks, in distribution)"
    assert report["comparison"]["estimate"] == train["arms"]["rloo"]["diff_vs_frozen"]["estimate"]
    assert report["control"]["what"] == ("shuffled final - frozen start "
                                         "(train tasks, in distribution)")

    # An experiment directory written before the train suite was evaluated: the finished
    # arms are evaluated on it when the experiment is run again, and train nothing more.
    steps = {name: _rl_steps(exp / "arms" / name) for name in ("rloo", "shuffled")}
    for name in ("rloo", "shuffled"):
        (exp / "arms" / name / "traces" / "eval-final-train.jsonl").unlink()
    again = _run(exp, tiny_agent_dir)
    assert _figures(again["suites"]) == _figures(suites)
    assert {name: _rl_steps(exp / "arms" / name) for name in steps} == steps
