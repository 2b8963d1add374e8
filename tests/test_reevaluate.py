"""``closedloop reevaluate``: more attempts for an experiment's finished policies, pooled with
their own evaluations and paired across arms, without training again; runs that cannot be
paired or are not finished are refused with the file and the reason."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from closedloop.cli import main
from closedloop.config import parse_config
from closedloop.contracts import load_episodes
from closedloop.contracts.metrics_log import read_metrics
from closedloop.errors import ConfigDriftError, RunStateError
from closedloop.evaluate.gates import evaluate_gates
from closedloop.evaluate.report import build_report
from closedloop.experiments.reevaluate import (
    EXTRA_SEED_BASE,
    load_version,
    reevaluate,
    reevaluate_experiment,
)
from closedloop.policy.registry import version_name
from closedloop.training.loop import opened_run
from closedloop.training.resume import resume
from closedloop.training.run_evaluation import evaluate
from tests.conftest import HELDOUT_TASKS, copy_experiment, experiment_config

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("experiment")]


@pytest.fixture()
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _rl_steps(arm: Path) -> int:
    return sum(1 for r in read_metrics(arm / "metrics.jsonl") if r["kind"] == "rl_step")


def test_more_attempts_are_pooled_with_each_arms_own_evaluation_and_paired(
        tiny_experiment: Path, tmp_path: Path, one_thread: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    exp = copy_experiment(tiny_experiment, tmp_path / "exp")
    steps = {arm: _rl_steps(exp / "arms" / arm) for arm in ("rloo", "shuffled")}
    final = version_name(steps["rloo"])  # each treated arm's published final
    claim = build_report(exp)["claim"]

    assert main(["reevaluate", str(exp), "--attempts", "2"]) == 0
    out = capsys.readouterr().out
    assert "rloo - frozen:" in out and "shuffled - frozen:" in out and "rloo - shuffled:" in out
    result = json.loads((exp / "reevaluation-heldout-more2.json").read_text())
    assert [(d["treated"], d["baseline"]) for d in result["diffs"]] == [
        ("rloo", "frozen"), ("shuffled", "frozen"), ("sft_only", "frozen"),
        ("rloo", "shuffled"), ("rloo", "sft_only"), ("shuffled", "sft_only")]
    for arm, version in (("frozen", "v0000"), ("rloo", final), ("shuffled", final),
                         ("sft_only", final)):  # the SFT-only arm: its published final
        run = result["runs"][arm]
        assert run["version"] == version
        own, more = (load_episodes(exp / "arms" / arm / "traces" / t)[1] for t in run["traces"])
        assert len(own) == HELDOUT_TASKS and len(more) == 2 * HELDOUT_TASKS
        assert run["episodes"] == 3 * HELDOUT_TASKS
        assert {e.trajectory.seed for e in more} == {EXTRA_SEED_BASE, EXTRA_SEED_BASE + 1}
    rloo, frozen = result["runs"]["rloo"]["per_task"], result["runs"]["frozen"]["per_task"]
    diff = result["diffs"][0]
    if len({*rloo.values(), *frozen.values()}) == 1 and set(rloo.values()) <= {0.0, 1.0}:
        assert diff["estimate"] is None  # every attempt of both failed (or succeeded)
    else:
        assert diff["estimate"] == pytest.approx(
            sum(rloo[t] - frozen[t] for t in rloo) / len(rloo))
    assert {arm: _rl_steps(exp / "arms" / arm) for arm in steps} == steps  # nothing trained
    gates = evaluate_gates(exp)  # after the reevaluation (below, only more_attempts changes)
    report = build_report(exp, gates)
    assert report["claim"] == claim  # the claim stays the preregistered one's
    # The report shows it beside the claim, recomputed from the traces the file names.
    (shown,) = report["more_attempts"]
    assert shown["measured"] and shown["file"] == "reevaluation-heldout-more2.json"
    for d, r in zip(shown["diffs"], result["diffs"], strict=True):
        if r["estimate"] is None:  # every attempt of both arms failed: no signal either way
            assert not d["measured"] and d["no_signal"]
        else:
            assert (d["estimate"], d["ci"]) == (r["estimate"], [r["lo"], r["hi"]])
    assert {a: shown["arms"][a]["episodes"] for a in shown["arms"]} == {
        a: 3 * HELDOUT_TASKS for a in ("frozen", "rloo", "shuffled", "sft_only")}
    written = exp / "reevaluation-heldout-more2.json"
    tampered = json.loads(written.read_text())
    tampered["diffs"][0]["estimate"] = 0.9  # figures in the file are never read
    written.write_text(json.dumps(tampered))
    assert build_report(exp, gates)["more_attempts"] == [shown]
    for traces, why in ((["eval-gone.jsonl"], "missing"), (["../../rloo/config.json"], "names"),
                        (["eval-final.jsonl", "eval-start.jsonl"], "policy versions")):
        tampered["runs"]["rloo"]["traces"] = traces
        written.write_text(json.dumps(tampered))
        (bad,) = build_report(exp, gates)["more_attempts"]
        assert not bad["measured"] and why in bad["detail"]
    written.write_text(json.dumps(result))

    # Again: every evaluation is reused from its trace, the same figures come back.
    traces = {p: p.stat().st_mtime_ns for p in exp.glob("arms/*/traces/eval-more2.jsonl")}
    again = reevaluate(exp / "arms" / "frozen", [exp / "arms" / "rloo"], 2)
    assert {p: p.stat().st_mtime_ns for p in traces} == traces
    assert again["diffs"][0]["estimate"] == diff["estimate"]

    # Refused: a baseline that is not at v0000, a run of another replicate's seed.
    with pytest.raises(RunStateError, match="baseline's start policy is v0000"):
        reevaluate(exp / "arms" / "rloo", [exp / "arms" / "shuffled"], 2)
    other = tmp_path / "other" / "rloo-seed1"
    shutil.copytree(exp / "arms" / "rloo", other)
    recorded = json.loads((other / "config.json").read_text())
    recorded["config"]["training"]["seed"] += 1
    (other / "config.json").write_text(json.dumps(recorded))
    with pytest.raises(ConfigDriftError, match=r"training\.seed differs"):
        reevaluate(exp / "arms" / "frozen", [other], 2)
    with pytest.raises(SystemExit, match="--baseline"):
        main(["reevaluate", str(exp / "arms" / "rloo"), str(other), "--attempts", "2"])


def test_a_step_reevaluates_that_version_and_scores_the_preregistered_seeds_where_unscored(
        tiny_agent_dir: Path, tiny_experiment: Path, tmp_path: Path, one_thread: None) -> None:
    cfg = parse_config(experiment_config(tiny_agent_dir))  # 2 steps; rloo: a point at step 1
    exp = copy_experiment(tiny_experiment, tmp_path / "exp")
    rloo = exp / "arms" / "rloo"
    assert (rloo / "traces" / "eval-step-0001.jsonl").is_file()
    assert not (exp / "arms" / "shuffled" / "traces" / "eval-step-0001.jsonl").is_file()

    # The earlier version loaded into a finished run samples what its curve point sampled.
    with opened_run(cfg, rloo) as run:
        resume(run)
        assert run.state.step == 2
        manifest = load_version(run, "v0001")
        assert manifest.policy_version == "v0001"
        evaluate(run, "check", manifest, seeds=cfg.evaluation.seeds[:1])
    point, check = (load_episodes(rloo / "traces" / f"eval-{n}.jsonl")[1]
                    for n in ("step-0001", "check"))
    assert [[t.action_token_ids for t in e.turns] for e in check] == \
        [[t.action_token_ids for t in e.turns] for e in point]

    result = reevaluate_experiment(exp, 2, step=1)
    assert (exp / "reevaluation-heldout-more2-v0001.json").is_file()
    runs = result["runs"]
    assert [runs[a]["version"] for a in ("frozen", "rloo", "shuffled")] == [
        "v0000", "v0001", "v0001"]
    assert runs["rloo"]["traces"] == ["eval-step-0001.jsonl", "eval-more2-v0001.jsonl"]
    assert runs["shuffled"]["traces"] == ["eval-more2-v0001.jsonl"]
    seeds = {e.trajectory.seed for e in load_episodes(
        exp / "arms" / "shuffled" / "traces" / "eval-more2-v0001.jsonl")[1]}
    assert seeds == {cfg.evaluation.seeds[0], EXTRA_SEED_BASE, EXTRA_SEED_BASE + 1}
    assert {runs[a]["episodes"] for a in runs} == {3 * HELDOUT_TASKS}  # every policy, same seeds
    with pytest.raises(ValueError, match=r"--step must be in 1\.\.2"):
        reevaluate_experiment(exp, 2, step=3)
    with pytest.raises(RunStateError, match="not a baseline"):
        reevaluate(exp / "arms" / "sft_only", [exp / "arms" / "rloo"], 2)
    assert not any((exp / "arms" / "sft_only" / "checkpoints").glob("*"))  # untouched
    with pytest.raises(ValueError, match="SFT-only control"):
        reevaluate(exp / "arms" / "frozen", [exp / "arms" / "sft_only"], 2, step=1)
