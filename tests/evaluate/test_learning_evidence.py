"""The report's learning evidence: the per-level cold-start table, the held-out curve, observed
vs predicted zero-variance rates, the learning-curve schedule and the pooled replicate effect."""

from pathlib import Path

import pytest

from closedloop.config import smoke_config
from closedloop.errors import ConfigDriftError
from closedloop.evaluate.learning import (
    cold_start_table,
    heldout_curve,
    template_and_level,
    zero_variance_table,
)
from closedloop.evaluate.rundir import RunDir, TraceFile
from closedloop.experiments.replicates import pool_replicates, replicate_config
from closedloop.training.loop import curve_steps
from tests.factories import make_traj, make_turn


def _trace(label: str, outcomes: list[tuple[str, float | None]], turns: int = 2) -> TraceFile:
    from closedloop.contracts import Episode, Termination

    eps = []
    for i, (task, success) in enumerate(outcomes):
        outcome = ({"termination": Termination.MAX_TOKEN_TRUNCATION} if success is None
                   else {"reward": {"task_success": success}})
        traj = make_traj(episode_id=f"{label}-{i}", task_id=task,
                         task_family=task.split("/")[0], num_turns=turns, **outcome)
        eps.append(Episode(traj, tuple(make_turn(k, episode_id=f"{label}-{i}")
                                       for k in range(turns))))
    return TraceFile(Path(f"eval-{label}.jsonl"), "eval", None, label, (), (), tuple(eps), ())


def _run(traces: dict[str, TraceFile], metrics=(), rl_steps=4) -> RunDir:
    return RunDir(path=Path("/nonexistent"), config={"training": {"rl_steps": rl_steps}},
                  config_meta={}, trainer=None, tasks=None, summary=None, audit=None,
                  metrics=tuple(metrics), traces=traces)


A_EXACT = "json-repair-v1/wrong-type.exact/001-aaaaaaaa"
A_SYMPTOM = "json-repair-v1/wrong-type.symptom/001-bbbbbbbb"
B_EXACT = "cli-repair-v1/off-by-one.exact/002-cccccccc"


def test_template_and_level_parse_leveled_and_plain_ids():
    assert template_and_level(A_EXACT) == ("wrong-type", "exact")
    assert template_and_level("json-repair-v1/missing-key/004-dddddddd") == ("missing-key",
                                                                             "unleveled")
    assert template_and_level("keydoor-v1/standard/004-dddddddd") == ("standard", "unleveled")


def test_cold_start_table_counts_per_cell_and_per_level_with_wilson_intervals():
    train = _trace("start-train", [(A_EXACT, 1.0), (B_EXACT, 0.0), (A_SYMPTOM, 0.0)])
    held = _trace("start", [(A_EXACT, 1.0), (A_EXACT, 0.0), (A_EXACT, None)])
    table = cold_start_table(_run({"eval-start-train": train, "eval-start": held}))
    by_level = {(r["suite"], r["level"]): r for r in table["by_level"]}
    assert by_level[("train", "exact")]["successes"] == 1
    assert by_level[("train", "exact")]["scored"] == 2
    assert by_level[("train", "exact")]["tasks"] == 2
    assert by_level[("train", "symptom")]["rate"] == 0.0
    # the unscored (censored) attempt is a task seen but not an attempt scored 0
    assert by_level[("heldout", "exact")]["scored"] == 2
    assert by_level[("heldout", "exact")]["rate"] == 0.5
    lo, hi = by_level[("heldout", "exact")]["ci"]
    assert 0 < lo < 0.5 < hi < 1


def test_heldout_curve_orders_points_and_counts_interactions_before_each():
    traces = {"eval-start": _trace("start", [(A_EXACT, 0.0), (A_EXACT, 0.0)]),
              "eval-step-0002": _trace("step-0002", [(A_EXACT, 1.0), (A_EXACT, 0.0)]),
              "eval-final": _trace("final", [(A_EXACT, 1.0), (A_EXACT, 1.0)])}
    for s in range(4):
        t = _trace(f"step-{s:04d}", [(A_EXACT, 1.0)], turns=3)
        traces[f"step-{s:04d}"] = TraceFile(Path(f"step-{s:04d}.jsonl"), "step", s, None, (),
                                            (), t.episodes, ())
    metrics = [{"kind": "rl_step", "step": s, "seconds": {"collect_s": 10.0}} for s in range(4)]
    curve = heldout_curve(_run(traces, metrics))
    assert [p["step"] for p in curve] == [0, 2, 4]
    assert [p["success"] for p in curve] == [0.0, 0.5, 1.0]
    assert [p["interactions"] for p in curve] == [0, 6, 12]
    assert [p["rl_wall_s"] for p in curve] == [0.0, 20.0, 40.0]


def test_zero_variance_prediction_is_the_one_made_before_the_draws():
    metrics = [
        {"kind": "task_sampler", "informative": {"predicted_next_rate": 0.5}},
        {"kind": "task_draws", "step": 0},
        {"kind": "task_sampler", "informative": {"predicted_next_rate": 0.25}},
        {"kind": "rl_step", "step": 0, "zero_variance": 1, "credit": {"n_scored_groups": 2}},
        {"kind": "task_draws", "step": 1},
        {"kind": "task_sampler", "informative": {"predicted_next_rate": 0.9}},
        {"kind": "rl_step", "step": 1, "zero_variance": 0, "credit": {"n_scored_groups": 2}},
    ]
    zv = zero_variance_table(_run({}, metrics))
    assert [r["predicted_rate"] for r in zv["steps"]] == [0.5, 0.25]
    assert [r["observed_rate"] for r in zv["steps"]] == [0.5, 0.0]
    assert zv["overall"]["observed_rate"] == 0.25
    assert zv["overall"]["predicted_rate"] == pytest.approx(0.375)


def test_curve_steps_spread_points_from_start_to_final():
    assert curve_steps(8, 3) == (0, 4, 8)
    assert curve_steps(2, 5) == (0, 1, 2)
    assert curve_steps(6, 4) == (0, 2, 4, 6)
    assert curve_steps(5, 2) == (0, 5)
    assert curve_steps(0, 3) == (0,)


def test_replicates_vary_learning_seeds_but_not_the_tasks():
    cfg = smoke_config()
    rep = replicate_config(cfg, 2)
    assert rep.training.seed == cfg.training.seed + 2
    assert rep.environment == cfg.environment  # task_seed, levels, sizes unchanged


def _rep(i: int, frozen: dict[str, float], rloo: dict[str, float], lo: float) -> dict:
    return {"replicate": i, "suites": {"heldout": {"arms": {
        "frozen": {"success": sum(frozen.values()) / len(frozen), "per_task": frozen},
        "rloo": {"success": sum(rloo.values()) / len(rloo), "per_task": rloo,
                 "diff_vs_frozen": {"estimate": 0.1, "lo": lo, "hi": 0.3}}}}}}


def test_pooled_effect_averages_replicates_per_task_and_counts_replicates_with_gain():
    tasks = [f"t{i}" for i in range(6)]
    r0 = _rep(0, dict.fromkeys(tasks, 0.0), dict.fromkeys(tasks, 1 / 3), lo=0.05)
    r1 = _rep(1, dict.fromkeys(tasks, 1 / 3), dict.fromkeys(tasks, 1 / 3), lo=-0.1)
    pooled = pool_replicates([r0, r1], seed=0)["heldout"]["rloo"]
    assert pooled["replicates_with_gain"] == 1
    # per task: mean rloo 1/3, mean frozen 1/6: pooled difference 1/6 on every task
    assert pooled["pooled"]["estimate"] == pytest.approx(1 / 6)
    assert pooled["pooled"]["tasks"] == 6 and pooled["pooled"]["replicates"] == 2
    assert [p["replicate"] for p in pooled["per_replicate"]] == [0, 1]


def test_pooling_skips_arms_a_suite_does_not_evaluate():
    tasks = [f"t{i}" for i in range(4)]
    reps = [_rep(i, dict.fromkeys(tasks, 0.0), dict.fromkeys(tasks, 0.5), lo=0.1)
            for i in range(2)]
    pooled = pool_replicates(reps, seed=0)["heldout"]
    assert set(pooled) == {"rloo"}  # shuffled and sft_only were never evaluated here


def test_the_rl_arm_is_pooled_against_its_shuffled_null_where_both_ran():
    tasks = [f"t{i}" for i in range(6)]
    reps = [_rep(i, dict.fromkeys(tasks, 0.0), dict.fromkeys(tasks, 2 / 3), lo=0.1)
            for i in range(2)]
    for r, null in zip(reps, (0.0, 1 / 3), strict=True):
        r["suites"]["heldout"]["arms"]["shuffled"] = {
            "success": null, "per_task": dict.fromkeys(tasks, null)}
    pooled = pool_replicates(reps, seed=0)["heldout"]
    assert set(pooled) == {"rloo", "shuffled", "rloo-vs-shuffled"}
    pair = pooled["rloo-vs-shuffled"]
    assert pair["baseline"] == "shuffled" and pooled["rloo"]["baseline"] == "frozen"
    # per replicate: computed from the per-task rates (the experiment records none)
    assert [p["diff_vs_shuffled"]["estimate"] for p in pair["per_replicate"]] == \
        pytest.approx([2 / 3, 1 / 3])
    assert [p["shuffled_success"] for p in pair["per_replicate"]] == [0.0, 1 / 3]
    # pooled per task: rloo 2/3, shuffled 1/6
    assert pair["pooled"]["estimate"] == pytest.approx(0.5) and pair["replicates_with_gain"] == 2
    del reps[1]["suites"]["heldout"]["arms"]["shuffled"]  # one replicate without its null
    pair = pool_replicates(reps, seed=0)["heldout"]["rloo-vs-shuffled"]
    assert pair["per_replicate"][1]["diff_vs_shuffled"] is None and "pooled" not in pair


def test_only_runs_the_chosen_replicates_and_pools_those_finished_elsewhere(tmp_path,
                                                                           monkeypatch):
    import json

    import closedloop.experiments.replicates as replicates

    tasks = [f"t{i}" for i in range(4)]
    ran: list[int] = []

    def fake_experiment(cfg, out, override=None):
        ran.append(cfg.training.seed - smoke_config().training.seed)
        return _rep(ran[-1], dict.fromkeys(tasks, 0.0), dict.fromkeys(tasks, 0.5), lo=0.1)

    monkeypatch.setattr(replicates, "run_experiment", fake_experiment)
    elsewhere = tmp_path / "replicate-0"
    (elsewhere / "arms" / "frozen").mkdir(parents=True)  # ran on another machine, copied here
    (elsewhere / "experiment.json").write_text(json.dumps(
        _rep(0, dict.fromkeys(tasks, 0.0), dict.fromkeys(tasks, 0.0), lo=0.0)))
    recorded = elsewhere / "arms" / "frozen" / "config.json"
    other = replicate_config(smoke_config(), 1).to_dict()  # replicate 1's seed, not 0's
    recorded.write_text(json.dumps({"config": other}))
    with pytest.raises(ConfigDriftError, match=r"training\.seed"):
        replicates.run_replicates(smoke_config(), tmp_path, 4, only=[2])
    assert ran == []
    recorded.write_text(json.dumps({"config": smoke_config().to_dict()}))
    data = replicates.run_replicates(smoke_config(), tmp_path, 4, only=[2])
    assert ran == [2]
    assert [r["replicate"] for r in data["replicates"]] == [0, 2] and data["missing"] == [1, 3]
    pooled = data["pooled"]["heldout"]["rloo"]["pooled"]
    assert pooled["replicates"] == 2 and pooled["estimate"] == pytest.approx(0.25)
    with pytest.raises(ValueError, match="--only"):
        replicates.run_replicates(smoke_config(), tmp_path, 2, only=[2])


def test_pool_measured_leaves_out_replicates_whose_gates_did_not_all_pass():
    from closedloop.experiments.replicates import pool_measured

    tasks = [f"t{i}" for i in range(4)]
    reps = [_rep(0, dict.fromkeys(tasks, 0.0), dict.fromkeys(tasks, 0.5), lo=0.1),
            _rep(1, dict.fromkeys(tasks, 0.5), dict.fromkeys(tasks, 0.0), lo=-0.6)]
    data = {"replicates": reps, "pooled": pool_replicates(reps)}
    claims = {0: {"all_gates_passed": True}, 1: {"all_gates_passed": False,
                                                 "failed_gates": ["cold_start_band"]}}
    pool_measured(data, claims)
    assert data["measured_replicates"] == [0]
    assert data["pooled"]["heldout"]["rloo"]["pooled"]["estimate"] == pytest.approx(0.0)
    measured = data["pooled_measured"]["heldout"]["rloo"]["pooled"]
    assert measured["estimate"] == pytest.approx(0.5) and measured["replicates"] == 1
    assert pool_measured(data, {0: {"all_gates_passed": False}})["pooled_measured"] == {}


def test_smoke_seeds_prints_each_replicates_claim_and_the_pool_of_measured_ones(
        tmp_path, monkeypatch, capsys):
    import json

    import closedloop.evaluate.report as report
    import closedloop.experiments.replicates as replicates
    from closedloop.cli import main

    tasks = [f"t{i}" for i in range(4)]

    def fake_experiment(cfg, out, override=None):
        i = cfg.training.seed - smoke_config().training.seed
        return _rep(i, dict.fromkeys(tasks, 0.0), dict.fromkeys(tasks, 0.5 * (1 - i)), lo=0.1)

    def fake_report(exp_dir):
        passed = Path(exp_dir).name == "replicate-0"
        claim = {"all_gates_passed": passed, "statement": "gain" if passed else "not measured"}
        Path(exp_dir).mkdir(parents=True, exist_ok=True)
        (Path(exp_dir) / "report.json").write_text(json.dumps({"claim": claim}))
        return str(Path(exp_dir) / "report.html"), {}

    monkeypatch.setattr(replicates, "run_experiment", fake_experiment)
    monkeypatch.setattr(report, "write_report", fake_report)
    assert main(["smoke", "--seeds", "2", "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "replicate 0: gain" in out and "replicate 1: not measured" in out
    assert "whose gates all passed: 0 ==" in out
    data = json.loads((tmp_path / "replicates.json").read_text())
    assert data["measured_replicates"] == [0]
    assert data["pooled_measured"]["heldout"]["rloo"]["pooled"]["estimate"] == pytest.approx(0.5)
    assert data["pooled"]["heldout"]["rloo"]["pooled"]["estimate"] == pytest.approx(0.25)
    with pytest.raises(SystemExit, match="needs --seeds"):
        main(["smoke", "--only", "1", "--run-dir", str(tmp_path)])


def _band_run(train_wins: int, heldout_wins: int) -> RunDir:
    train = _trace("start-train", [(f"{A_EXACT[:-12]}{i:03d}-aaaaaaaa", float(i < train_wins))
                                   for i in range(10)])
    held = _trace("start", [(f"{B_EXACT[:-12]}{i:03d}-cccccccc", float(i < heldout_wins))
                            for i in range(10)])
    run = _run({"eval-start-train": train, "eval-start": held})
    run.config["evaluation"] = {"cold_start_band": [0.15, 0.6]}
    return run


@pytest.mark.parametrize("train_wins, heldout_wins, passed", [
    (3, 2, True),     # train 0.3 in [0.15, 0.6], held-out 0.2 in (0, 0.6)
    (0, 2, False),    # a cold start that never succeeds on train: nothing to sharpen
    (9, 2, False),    # one that nearly always succeeds: nothing to gain
    (3, 0, False),    # held-out at 0
])
def test_cold_start_band_gate(train_wins, heldout_wins, passed):
    from closedloop.evaluate.gates.base import GateOptions
    from closedloop.evaluate.gates.signal import gate_cold_start_band

    gate = gate_cold_start_band(_band_run(train_wins, heldout_wins), GateOptions())
    assert gate.passed is passed, gate.detail
    assert gate.evidence["train_success"] == train_wins / 10


def test_cold_start_band_is_not_measured_without_the_train_evaluation():
    from closedloop.evaluate.gates.base import GateOptions
    from closedloop.evaluate.gates.signal import gate_cold_start_band

    run = _band_run(3, 2)
    del run.traces["eval-start-train"]
    assert gate_cold_start_band(run, GateOptions()).passed is None


def test_the_experiment_printout_names_each_other_suite_with_its_arms() -> None:
    from closedloop.cli.text import suite_lines

    arm = {"success": 0.5, "diff_vs_frozen": {"estimate": 0.25, "lo": 0.0, "hi": 0.5}}
    suites = {s: {"tasks": 8, "arms": {"frozen": {"success": 0.25}, "rloo": arm}}
              for s in ("heldout", "family", "train")}
    lines = suite_lines({"suites": suites})
    assert lines[0] == "== family suite (8 tasks, families never trained on) =="
    assert lines[3] == "== train suite (8 tasks, the train tasks RL drew from, in distribution) =="
    assert lines[4] == "frozen    success 0.250"
    assert lines[5] == "rloo      success 0.500  diff 0.250 [0.000, 0.500]"
    assert suite_lines({"suites": {"heldout": suites["heldout"]}}) == []


def test_replicates_json_is_written_once_with_each_replicates_claim(tmp_path, monkeypatch):
    import json

    import closedloop.experiments.replicates as replicates

    tasks = [f"t{i}" for i in range(4)]
    written: list[bytes] = []
    real_write = replicates.atomic_write_bytes

    def recording_write(path, data):
        written.append(data)
        real_write(path, data)

    def fake_experiment(cfg, out, override=None):
        i = cfg.training.seed - smoke_config().training.seed
        return _rep(i, dict.fromkeys(tasks, 0.0), dict.fromkeys(tasks, 0.5 * (1 - i)), lo=0.1)

    monkeypatch.setattr(replicates, "run_experiment", fake_experiment)
    monkeypatch.setattr(replicates, "atomic_write_bytes", recording_write)
    seen: list[str] = []

    def claim_of(rep_dir):
        seen.append(rep_dir.name)
        return {"all_gates_passed": rep_dir.name == "replicate-0", "statement": rep_dir.name}

    data = replicates.run_replicates(smoke_config(), tmp_path, 2, claim_of=claim_of)
    assert seen == ["replicate-0", "replicate-1"] and len(written) == 1
    on_disk = json.loads((tmp_path / "replicates.json").read_text())
    assert on_disk == json.loads(json.dumps(data))
    assert on_disk["measured_replicates"] == [0] and set(on_disk["claims"]) == {"0", "1"}
    assert on_disk["pooled_measured"]["heldout"]["rloo"]["pooled"]["estimate"] == \
        pytest.approx(0.5)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
