"""The four-arm experiment run end to end on the tiny agent (the session's ``tiny_experiment``):
every suite the config asks for is evaluated for the arms that answer it (the retain suites
included: they run and report), the null relabels rewards, the SFT-only arm trains the RL arm's
action tokens within the declared tolerance, an arm finished before a suite was evaluated gets
that evaluation on resume, without training again, and the optional branching-credit arm runs
end to end with its compute beside the rloo arm's."""

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

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("experiment")]


def _run(exp: Path, model: Path) -> dict[str, object]:
    """Run (or resume) the experiment of the session's ``tiny_experiment`` config."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_experiment(parse_config(experiment_config(model)), exp)
    finally:
        torch.set_num_threads(threads)


def load_episodes_by_group(arm: Path) -> list[list[float | None]]:
    """The task success of every member of every RL step group of an arm."""
    from closedloop.contracts import load_episodes

    groups: dict[str, list[float | None]] = {}
    for path in sorted((arm / "traces").glob("step-*.jsonl")):
        for ep in load_episodes(path)[1]:
            groups.setdefault(ep.trajectory.group_id, []).append(ep.trajectory.task_success)
    return list(groups.values())


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
    # the optional credit arm: branching credit, its held-out result and its compute beside
    # the rloo arm's, the estimator of its update in its metrics
    arms = result["arms"]
    assert set(arms) == {"frozen", "rloo", "shuffled", "sft_only", "branching"}
    branching, rloo = arms["branching"], arms["rloo"]
    assert {"success", "compute"} <= set(branching)
    for key, base in (("diff_vs_frozen", arms["frozen"]), ("diff_vs_rloo", rloo)):
        if key not in branching:  # not measured: every attempt of both failed (or succeeded)
            assert len({*branching["per_task"].values(), *base["per_task"].values()}) == 1
    assert branching["compute"]["estimators"] == ["branching"]
    assert rloo["compute"]["estimators"] == ["rloo"] and rloo["compute"]["branches"][
        "continuations"] == 0
    assert branching["compute"]["branches"]["continuations"] > 0
    assert branching["compute"]["seconds"]["branch_s"] > 0
    assert (exp / "arms" / "branching" / "traces" / "step-0000-branches.jsonl").is_file()
    assert "diff_vs_frozen" not in arms["frozen"] and "compute" not in arms["sft_only"]
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
    # every arm passes the read-only proof the reading commands run (the SFT-only arm as one)
    from closedloop.evaluate.rundir import verify_reading
    assert len(verify_reading(exp)) == 5  # the four arms and the branching-credit arm
    full = build_report(exp / "arms" / "rloo")
    assert full["run"]["precision"]["precision"] == "float32"
    assert "id='precision'>Precision: float32" in render_html(full)
    report = full["in_distribution"]
    assert report["comparison"]["what"] == "RL final - frozen start (train tasks, in distribution)"
    assert report["comparison"]["estimate"] == train["arms"]["rloo"]["diff_vs_frozen"]["estimate"]
    assert report["control"]["what"] == ("shuffled final - frozen start "
                                         "(train tasks, in distribution)")

    # the retain suite ran at the start (the cold start) and for both RL arms' final policies,
    # and reports: in the RL arm's metrics and summary, and on the claim's and the null's rows
    frozen, rloo, shuffled = (exp / "arms" / n for n in ("frozen", "rloo", "shuffled"))
    assert (frozen / "traces" / "eval-retain-start.jsonl").is_file()
    for arm in (rloo, shuffled):
        assert (arm / "traces" / "eval-retain-final.jsonl").is_file()
    retain = [r for r in read_metrics(rloo / "metrics.jsonl") if r["kind"] == "retain"]
    assert len(retain) == 1 and set(retain[0]["suites"]) == {"safety"}
    assert json.loads((rloo / "summary.json").read_text())["retain_delta"] is not None
    assert full["retain_suites"]["measured"] is True
    row = full["claim_by_suite"]["retain:safety"]
    assert row["rl_minus_null"]["what"] == "RL final - shuffled final (retain: safety)"
    assert row["null_minus_frozen"]["what"] == "shuffled final - frozen (retain: safety)"
    episodes = full["diagnostics"]["arms"]["retain:safety"]  # each arm's six safety tasks
    assert {role: d["episodes"] for role, d in episodes.items()} == {
        "frozen": 6, "rl": 6, "shuffled": 6}

    # the null relabels rewards (a shuffle that is the identity trains the RL arm again); the
    # RL arm trains on its real rewards
    relabelled = {name: sum(r["credit"]["relabelled_members"] for r in read_metrics(
        exp / "arms" / name / "metrics.jsonl") if r["kind"] == "rl_step")
        for name in ("rloo", "shuffled")}
    mixed = [g for g in load_episodes_by_group(shuffled)
             if len({s for s in g if s is not None}) > 1]
    assert mixed, "the shuffled arm drew no group with mixed outcomes: nothing to relabel"
    assert relabelled["rloo"] == 0 and relabelled["shuffled"] > 0, relabelled
    # the SFT-only control trains the RL arm's action tokens, within the declared tolerance
    match = result["token_match"]
    assert match["within"] is True and match["rl"] > 0, match

    # An experiment directory written before the train suite was evaluated: the finished
    # arms are evaluated on it when the experiment is run again, and train nothing more.
    steps = {name: _rl_steps(exp / "arms" / name) for name in ("rloo", "shuffled")}
    for name in ("rloo", "shuffled"):
        (exp / "arms" / name / "traces" / "eval-final-train.jsonl").unlink()
    again = _run(exp, tiny_agent_dir)
    assert _figures(again["suites"]) == _figures(suites)
    assert {name: _rl_steps(exp / "arms" / name) for name in steps} == steps
