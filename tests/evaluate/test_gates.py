"""Go/no-go gates: each passes on a clean run and fails on a run broken the way it guards against.

The clean run (tests/evaluate/synthetic_run.py) is built with the real collector, environment,
verifier, registry, ledger, admission controller and checkpoints; broken runs are copies with
one defect written into their files (raw JSON where the record classes would refuse it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from closedloop.cli import main
from closedloop.envs.terminal import TerminalRepairEnv, graders
from closedloop.envs.terminal.families.registry import get_spec
from closedloop.envs.terminal.fixtures import default_fixture_task_ids
from closedloop.envs.terminal.package import terminal_package
from closedloop.errors import SealedSnapshotError
from closedloop.evaluate import gates as gates_pkg
from closedloop.evaluate.gates import (
    GATE_NAMES,
    GateOptions,
    GateReport,
    environment,
    evaluate_gates,
    format_table,
    live,
)
from closedloop.learn.objectives import BoundObjective as Objective
from closedloop.policy.registry import PolicyRegistry
from closedloop.rollout.ledger import DuplicateConsumptionError, Ledger
from tests.evaluate.synthetic_run import (
    Spec,
    audit_record,
    build_eval_run,
    build_run,
    clean_experiment,
    clean_gates,
    clean_run,
    copy_run,
    edit_trace,
    experiment_gates,
)

NOT_MEASURED_ON_A_PLAIN_RUN = {"train_inference_mismatch", "shuffled_reward_control"}


def gate(run: Path, name: str, **opts: Any) -> Any:
    (g,) = evaluate_gates(run, GateOptions(**opts), only=[name]).gates
    return g


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def _write(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data))


# --------------------------------------------------------------------------- the clean run
def test_clean_run_passes_every_measurable_gate() -> None:
    report = clean_gates()
    assert [g.name for g in report.gates] == list(GATE_NAMES) and len(GATE_NAMES) == 23
    for g in report.gates:
        want = None if g.name in NOT_MEASURED_ON_A_PLAIN_RUN else True
        assert g.passed is want, (g.name, g.detail)
    assert report.gate("async_equals_sync").status == "N/A"
    assert report.failed == [] and not report.all_passed and report.exit_code == 3
    ev = report.gate("exactly_once_groups").evidence
    assert (ev["expected_groups"], ev["consumed_once"], ev["lost"]) == (4, 4, 0)
    lp = report.gate("behavior_logprobs_finite_aligned").evidence
    assert lp["trainer_batch_tokens_checked"] > 0
    assert report.gate("reset_state_hash").evidence["episodes"] == 34  # 2 demos + 8 RL + 24 eval
    assert json.loads(json.dumps(report.to_dict()))["all_passed"] is False


def test_a_crashing_check_fails_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(run: Any, opts: Any) -> Any:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(gates_pkg, "GATES", (("termination_codes", boom),))
    (g,) = evaluate_gates(clean_run()).gates
    assert g.passed is False and "disk on fire" in g.detail


def test_unknown_gate_name_is_refused() -> None:
    with pytest.raises(KeyError):
        evaluate_gates(clean_run(), only=["no_such_gate"])


# --------------------------------------------------------------------------- trace gates
def test_invalid_trace_line(tmp_path: Path) -> None:
    run = copy_run(tmp_path / "run")
    with open(run / "traces" / "step-0001.jsonl", "a") as fh:
        fh.write('{"record": "turn", "bogus": 1}\n')
    g = gate(run, "trace_records_valid")
    assert g.passed is False and g.evidence["invalid_lines"] == 1


@pytest.mark.parametrize("defect", ["shifted_mask", "shifted_logprobs", "nan", "missing"])
def test_logprob_gate_fails_on_misaligned_or_nonfinite_logprobs(tmp_path: Path,
                                                                defect: str) -> None:
    run = copy_run(tmp_path / "run")
    assert gate(run, "behavior_logprobs_finite_aligned").passed is True

    def mutate(raw: dict[str, Any]) -> dict[str, Any] | None:
        if raw["record"] != "turn" or raw["episode_id"] != "s0000-g0/0" or raw["turn"] != 0:
            return None
        if defect == "shifted_mask":  # the mask moved one token right: one entry too many
            raw["action_mask"] = [0, *raw["action_mask"]]
        elif defect == "shifted_logprobs":
            raw["behavior_logprobs"] = raw["behavior_logprobs"][1:]
        elif defect == "nan":
            raw["behavior_logprobs"][0] = math.nan
        else:
            raw["behavior_logprobs"] = []
        return raw

    assert edit_trace(run, "step-0000", mutate) == 1
    g = gate(run, "behavior_logprobs_finite_aligned")
    assert g.passed is False
    key = "non_finite" if defect == "nan" else "misaligned_turns"
    assert g.evidence[key] == 1


def test_logprob_gate_catches_a_trainer_batch_shifted_by_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    from closedloop.rollout import tensors

    real = tensors.shift_targets
    monkeypatch.setattr(tensors, "shift_targets", lambda batch: replace(
        real(batch), mask_B_T=torch.roll(real(batch).mask_B_T, 1, dims=1)))
    g = gate(clean_run(), "behavior_logprobs_finite_aligned")
    assert g.passed is False and g.evidence["trainer_batch_rows_misaligned"] > 0


def _swap_version(raw: dict[str, Any], episode: str, version: str, manifest: str) -> Any:
    if raw.get("episode_id") == episode and raw["record"] in ("turn", "trajectory"):
        raw.update(behavior_policy_version=version, policy_manifest_hash=manifest)
        return raw
    return None


def test_mixed_version_group_fails(tmp_path: Path) -> None:
    run = copy_run(tmp_path / "run")
    v0 = PolicyRegistry(run / "registry").manifest("v0000").manifest_hash()
    # sibling 1 of a step-1 group was sampled by v0000 (the whole episode, consistently)
    assert edit_trace(run, "step-0001",
                      lambda r: _swap_version(r, "s0001-g0/1", "v0000", v0)) > 1
    g = gate(run, "one_behavior_version")
    assert g.passed is False
    assert (g.evidence["mixed_groups"], g.evidence["mixed_episodes"]) == (1, 0)


def test_mixed_version_episode_fails(tmp_path: Path) -> None:
    run = copy_run(tmp_path / "run")
    v0 = PolicyRegistry(run / "registry").manifest("v0000").manifest_hash()

    def one_turn(raw: dict[str, Any]) -> Any:
        if raw["record"] == "turn" and raw["episode_id"] == "s0001-g0/0" and raw["turn"] == 1:
            return _swap_version(raw, "s0001-g0/0", "v0000", v0)
        return None

    assert edit_trace(run, "step-0001", one_turn) == 1
    report = evaluate_gates(run, only=["trace_records_valid", "one_behavior_version"])
    assert report.gate("one_behavior_version").evidence["mixed_episodes"] == 1
    assert report.failed == ["trace_records_valid", "one_behavior_version"]


def _failed_trajectory(raw: dict[str, Any]) -> bool:
    return raw["record"] == "trajectory" and raw["reward"] is not None and \
        raw["reward"]["task_success"] == 0.0


def test_censored_episode_scored_zero_fails(tmp_path: Path) -> None:
    run = copy_run(tmp_path / "run")
    assert gate(run, "termination_codes").passed is True

    def censor(raw: dict[str, Any]) -> Any:
        if _failed_trajectory(raw):  # a truncated episode silently scored 0
            raw["termination"] = "max_step_truncation"
            return raw
        return None

    assert edit_trace(run, "step-0000", censor) == 2
    g = gate(run, "termination_codes")
    assert g.passed is False
    assert g.evidence["censored_with_reward"] == g.evidence["censored_scored_zero"] == 2


def test_terminal_episode_left_unscored_fails(tmp_path: Path) -> None:
    run = copy_run(tmp_path / "run")
    edit_trace(run, "eval-start", lambda r: {**r, "reward": None} if _failed_trajectory(r)
               else None)
    g = gate(run, "termination_codes")
    assert g.passed is False and g.evidence["terminal_unscored_unquarantined"] == 4


def test_drifted_system_prompt_fails_scaffold_gate(tmp_path: Path) -> None:
    assert clean_gates().gate("manifest_scaffold_drift").evidence["scaffold_hashes"] == 1
    run = build_run(tmp_path / "run", Spec(prompts=("You repair files with tools.",) * 2
                                           + ("You repair files. Be brief.",)))
    g = gate(run, "manifest_scaffold_drift")
    assert g.passed is False and g.evidence["scaffold_hashes"] == 2


def test_unregistered_manifest_and_off_scaffold_demo_fail(tmp_path: Path) -> None:
    run = copy_run(tmp_path / "run")
    other = "sha256:" + "ab" * 32
    edit_trace(run, "eval-final", lambda r: {**r, "policy_manifest_hash": other}
               if r["record"] == "trajectory" else None)
    edit_trace(run, "sft-demos", lambda r: {**r, "policy_manifest_hash": other}
               if r["record"] == "turn" else None)
    g = gate(run, "manifest_scaffold_drift")
    assert g.passed is False
    assert g.evidence["unregistered_by_file"] == {"eval-final": 8}
    assert g.evidence["demo_records_off_scaffold"] > 0


# --------------------------------------------------------------------------- environment
def _shift_observations(raw: dict[str, Any]) -> Any:
    return {**raw, "observation": raw["observation"] + " (edited)"} \
        if raw["record"] == "turn" and raw["observation"] else None


def test_reset_gate_fails_when_the_recorded_base_state_differs(tmp_path: Path) -> None:
    run = copy_run(tmp_path / "run")
    edit_trace(run, "step-0000", lambda r: {**r, "state_before": "sha256:" + "0" * 64}
               if r["record"] == "turn" and r["episode_id"] == "s0000-g1/1" and r["turn"] == 0
               else None)
    g = gate(run, "reset_state_hash")
    assert g.passed is False and g.evidence["mismatched"] == 1


def test_replay_gate_fails_on_a_recorded_observation_that_does_not_reproduce(
        tmp_path: Path) -> None:
    run = copy_run(tmp_path / "run")
    for name in ("step-0000", "step-0001", "eval-start", "eval-start-train", "eval-final",
                 "sft-demos"):
        edit_trace(run, name, _shift_observations)
    g = gate(run, "restore_replay")
    assert g.passed is False and g.evidence["reproduced"] == 0


class NoRestoreEnv(TerminalRepairEnv):
    """Broken: restore keeps the current state (a snapshot that restores another hash)."""

    def restore(self, snapshot: Any) -> None:
        return None


class LeakyForkEnv(TerminalRepairEnv):
    """Broken: fork hands back the parent itself, so branches share state."""

    def fork(self, snapshot: Any, branch_id: str) -> Any:
        self.restore(snapshot)
        return self


class OpenSealEnv(TerminalRepairEnv):
    """Broken: restoring a sealed terminal snapshot is silently accepted."""

    def restore(self, snapshot: Any) -> None:
        with contextlib.suppress(SealedSnapshotError):
            super().restore(snapshot)


def _use_env(monkeypatch: pytest.MonkeyPatch, make: Any) -> None:
    """The gates rebuild the run's package: give it a broken env factory."""
    package = dataclasses.replace(terminal_package(), make_env=make)
    monkeypatch.setattr(environment, "package_of", lambda run: package)


def test_replay_gate_fails_on_an_env_whose_restore_is_broken(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _use_env(monkeypatch, lambda: NoRestoreEnv(get_spec))
    g = gate(clean_run(), "restore_replay")
    assert g.passed is False and g.evidence["suffix_reproduced"] < g.evidence["suffix_replays"]


@pytest.mark.parametrize("env_cls", [LeakyForkEnv, OpenSealEnv])
def test_fork_isolation_and_seal_gate_fails_on_broken_envs(
        monkeypatch: pytest.MonkeyPatch, env_cls: type) -> None:
    _use_env(monkeypatch, lambda: env_cls(get_spec))
    g = gate(clean_run(), "fork_isolation_and_seal")
    assert g.passed is False
    assert ("ForkIsolationError" if env_cls is LeakyForkEnv else "sealed") in g.detail


# --------------------------------------------------------------------------- registry, roles
def test_worker_ack_with_other_checksum_fails(tmp_path: Path) -> None:
    run = copy_run(tmp_path / "run")
    ack = run / "registry" / "acks" / "v0001" / "generator-0.json"
    _write(ack, {**_json(ack), "checksum_loaded": "sha256:" + "1" * 64})
    g = gate(run, "weight_checksums")
    assert g.passed is False and g.evidence["ack_mismatches"] == ["v0001/generator-0"]


def test_registry_weights_that_do_not_verify_fail(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    run = copy_run(tmp_path / "run")
    save_file({"w": torch.zeros(2, 2)}, str(run / "registry/versions/v0001/weights.safetensors"))
    g = gate(run, "weight_checksums")
    assert g.passed is False and g.evidence["verified"] == 2


@pytest.mark.parametrize("defect", ["trainer_beta", "no_kl_logged", "reference_role"])
def test_policy_roles_gate(tmp_path: Path, defect: str) -> None:
    run = copy_run(tmp_path / "run")
    if defect == "trainer_beta":
        _write(run / "trainer.json", {**_json(run / "trainer.json"), "kl_beta": 0.5})
    elif defect == "no_kl_logged":
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        for m in lines:
            if m["kind"] == "rl_step":
                m["metrics"]["losses/kl"] = None
        (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    else:
        cfg = _json(run / "config.json")
        cfg["config"]["update"]["proximal_policy"] = "reference_policy"
        _write(run / "config.json", cfg)
    assert gate(run, "policy_roles_unambiguous").passed is False


@pytest.mark.parametrize(("change", "passed"), [
    ({}, True),
    ({"abs_max": 0.3}, False),
    ({"abs_p95": 5e-4}, False),  # above tolerance_p95 = 1e-4
    ({"k3": 0.01}, False),
    ({"weight_checksum": "sha256:" + "2" * 64}, False),  # audited other weights
    ({"n_tokens": 0}, False),
])
def test_train_inference_mismatch_from_audit(tmp_path: Path, change: dict[str, Any],
                                             passed: bool) -> None:
    run = copy_run(tmp_path / "run")
    assert gate(run, "train_inference_mismatch").passed is None
    _write(run / "audit.json", {**audit_record(run), **change})
    assert gate(run, "train_inference_mismatch").passed is passed


def test_train_inference_mismatch_fails_on_logged_ratio_tail(tmp_path: Path) -> None:
    run = copy_run(tmp_path / "run")
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for m in lines:
        if m["kind"] == "rl_step":
            m["metrics"]["ratio/ratio_max"] = 1.5
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    assert gate(run, "train_inference_mismatch").passed is False


# --------------------------------------------------------------------------- ledger gates
def test_stale_group_fails_the_version_lag_gate(tmp_path: Path) -> None:
    # a v0000 group held back and applied by step 2, together with v0001's groups: lag 1
    run = build_run(tmp_path / "run", Spec(hold_back_first_group=True))
    report = evaluate_gates(run, only=["max_version_lag", "exactly_once_groups"])
    lag = report.gate("max_version_lag")
    assert lag.passed is False and lag.evidence["lag_histogram"] == {"0": 3, "1": 1}
    assert report.gate("exactly_once_groups").passed is True  # it was still applied once


def _copy_group(src_group: str, new_group: str | None = None) -> Any:
    """Edit function appending (a renamed copy of) every line of one step-0 group."""
    lines = [json.loads(x) for x in (clean_run() / "traces/step-0000.jsonl").read_text()
             .splitlines() if json.loads(x)["group_id"] == src_group]
    done = []

    def add(raw: dict[str, Any]) -> Any:
        if done:
            return None
        done.append(1)
        copies = [json.loads(json.dumps(x).replace(src_group, new_group or src_group))
                  for x in lines]
        return [raw, *copies]
    return add


def test_duplicated_group_fails_exactly_once(tmp_path: Path) -> None:
    run = copy_run(tmp_path / "run")
    edit_trace(run, "step-0001", _copy_group("s0000-g0"))
    g = gate(run, "exactly_once_groups")
    assert g.passed is False
    assert (g.evidence["duplicate_groups_in_traces"], g.evidence["lost"]) == (1, 0)


def test_lost_group_fails_exactly_once_and_stratification(tmp_path: Path) -> None:
    run = copy_run(tmp_path / "run")
    edit_trace(run, "step-0001", _copy_group("s0000-g0", "s0001-g7"))
    report = evaluate_gates(run, only=["exactly_once_groups", "stale_drop_stratified"])
    assert report.gate("exactly_once_groups").evidence["lost"] == 1
    assert report.gate("stale_drop_stratified").evidence["unstratified_samples"] == 2
    assert report.failed == ["exactly_once_groups", "stale_drop_stratified"]


def test_refused_duplicate_consumption_is_counted_not_failed(tmp_path: Path) -> None:
    run = copy_run(tmp_path / "run")
    with Ledger(run / "ledger.sqlite") as ledger, pytest.raises(DuplicateConsumptionError):
        ledger.mark_consumed(["s0000-g0"], 3, "v0003")
    g = gate(run, "exactly_once_groups")
    assert g.passed is True and g.evidence["duplicate_attempts"] == 1


LEDGER_GATES = ["max_version_lag", "exactly_once_groups", "stale_drop_stratified"]


def _edit_ledger(run: Path, sql: str) -> None:
    import sqlite3
    conn = sqlite3.connect(run / "ledger.sqlite")
    conn.execute(sql)
    conn.commit()
    conn.close()


def test_a_tampered_ledger_row_fails_the_ledger_gates(tmp_path: Path) -> None:
    # one digit of a task id changed: still a valid SQLite file, rows consistent with their
    # events, but not with the digest the checkpoint recorded
    run = copy_run(tmp_path / "run")
    assert evaluate_gates(run, only=LEDGER_GATES).failed == []
    _edit_ledger(run, "UPDATE groups SET task_id = task_id || '1' WHERE seq = 2")
    report = evaluate_gates(run, only=LEDGER_GATES)
    assert report.failed == LEDGER_GATES
    for g in report.gates:
        assert "LedgerCorruptError" in g.detail and "ledger.sqlite" in g.detail
        assert "do not match their recorded hash" in g.detail


def test_a_ledger_row_that_is_not_utf8_is_a_named_error(tmp_path: Path) -> None:
    run = copy_run(tmp_path / "run")
    _edit_ledger(run, "UPDATE groups SET run_id = CAST(X'ff61' AS TEXT) WHERE seq = 3")
    report = evaluate_gates(run, only=LEDGER_GATES)
    assert report.failed == LEDGER_GATES
    detail = report.gate("exactly_once_groups").detail
    assert "LedgerCorruptError" in detail and str(run / "ledger.sqlite") in detail
    assert "groups row 3" in detail and "OperationalError" not in detail


def test_stratified_rates_cover_every_sample() -> None:
    ev = clean_gates().gate("stale_drop_stratified").evidence
    assert ev["samples"] == 8
    assert sum(row["n"] for row in ev["reward_band"].values()) == 8
    assert set(ev["reward_band"]) == {"success", "failure"}


@pytest.mark.parametrize("defect", ["seed", "sample_index", "no_checkpoint"])
def test_provenance_gate(tmp_path: Path, defect: str) -> None:
    import shutil

    run = copy_run(tmp_path / "run")
    if defect == "no_checkpoint":
        shutil.rmtree(run / "checkpoints")
    else:
        key, value = ("seed", 999) if defect == "seed" else ("sample_index", 0)
        edit_trace(run, "step-0000", lambda r: {**r, key: value}
                   if r["record"] == "trajectory" and r["episode_id"] == "s0000-g0/1" else None)
    assert gate(run, "sample_provenance_complete").passed is False


def test_async_gate_is_not_applicable_to_a_sync_run_and_fails_without_its_records(
        tmp_path: Path) -> None:
    g = clean_gates().gate("async_equals_sync")
    assert (g.passed, g.applicable) == (True, False)
    run = copy_run(tmp_path / "run")
    cfg = _json(run / "config.json")
    cfg["config"]["rollout"]["mode"] = "async"
    _write(run / "config.json", cfg)
    g = gate(run, "async_equals_sync")  # steps trained on the async path, nothing compared
    assert g.passed is False and "no async/sync equivalence record" in g.detail
    cfg["config"]["rollout"]["max_version_lag"] = 1
    _write(run / "config.json", cfg)
    assert gate(run, "async_equals_sync").applicable is False  # defined at lag 0 only


# --------------------------------------------------------------------------- objective
def test_episode_sum_gate_fails_when_the_objective_normalizes_by_length(
        monkeypatch: pytest.MonkeyPatch) -> None:
    g = gate(clean_run(), "episode_sum_score_function")
    assert g.passed is True and g.evidence["max_abs_weight_diff"] <= 1e-12
    assert g.evidence["steps"] == 2 and g.evidence["episodes"] == 8  # the run's RL batches
    real = live.get_objective

    def length_normalizing(name: str, clip: Any = None) -> Objective:
        inner = real(name, clip)
        return Objective(name, inner.uses_ratio,
                         lambda x: inner(dataclasses.replace(x, reducer="length_normalized")))

    monkeypatch.setattr(live, "get_objective", length_normalizing)
    g = gate(clean_run(), "episode_sum_score_function")
    assert g.passed is False and g.evidence["max_abs_weight_diff"] > 1e-3


def test_episode_sum_gate_reads_the_runs_objective_and_labels_other_reducers(
        tmp_path: Path) -> None:
    run = copy_run(tmp_path / "run")
    trainer = _json(run / "trainer.json")
    _write(run / "trainer.json", {**trainer, "objective": "ppo_clip"})
    g = gate(run, "episode_sum_score_function")
    assert g.passed is True and g.evidence["objective"] == "ppo_clip"
    assert g.evidence["run_uses_score_function"] is True
    _write(run / "trainer.json", {**trainer, "reducer": "length_normalized"})
    g = gate(run, "episode_sum_score_function")
    assert g.passed is True and g.evidence["run_uses_score_function"] is False
    assert "labelled surrogate" in g.detail and g.evidence["token_weight_spread"] > 1.5
    for step in (run / "traces").glob("step-*.jsonl"):
        step.unlink()
    assert gate(run, "episode_sum_score_function").passed is None  # no recorded RL batch


@pytest.mark.fresh_verifier_audit
def test_verifier_gate_fails_with_a_lenient_grader(monkeypatch: pytest.MonkeyPatch) -> None:
    assert clean_gates().gate("verifier_fp_fn").passed is True
    json_tasks = tuple(t for t in default_fixture_task_ids() if t.startswith("json-repair"))
    strict = gate(clean_run(), "verifier_fp_fn", fixture_task_ids=json_tasks)
    assert strict.evidence["fp"] == 0  # (too few fixtures for the bound: not a pass on its own)
    monkeypatch.setattr(graders, "loads_strict", json.loads)  # accepts duplicate keys
    g = gate(clean_run(), "verifier_fp_fn", fixture_task_ids=json_tasks)  # fast: no programs
    # the duplicate-key negative fixtures are now accepted
    assert g.passed is False and g.evidence["fp"] > 0
    assert g.evidence["n_negative"] == strict.evidence["n_negative"]
    assert g.evidence["fp_ci"][1] > environment.FP_UPPER_BOUND
    assert f"FP {g.evidence['fp']}/{g.evidence['n_negative']}" in g.detail


# --------------------------------------------------------------------------- experiment
def test_shuffled_control_with_stable_gain_fails(tmp_path: Path) -> None:
    import shutil

    exp = Path(shutil.copytree(clean_experiment(), tmp_path / "exp"))
    shutil.rmtree(exp / "arms" / "shuffled")  # a null arm that gains on every task
    build_eval_run(exp / "arms" / "shuffled", lambda t, k: False, lambda t, k: True)
    g = gate(exp, "shuffled_reward_control")
    assert g.passed is False and g.evidence["suites"]["heldout"]["ci"][0] > 0
    assert g.evidence["baseline"] == "frozen"


def test_experiment_with_every_gate_passing() -> None:
    report = experiment_gates()
    assert report.run_dir.endswith("arms/rloo")  # the RL arm's gates decide
    assert report.all_passed and report.exit_code == 0, report.failed + report.not_measured
    shuffled = report.gate("shuffled_reward_control")
    heldout = shuffled.evidence["suites"]["heldout"]
    assert heldout["estimate"] == 0.0 and heldout["tasks"] == 4
    assert report.gate("train_inference_mismatch").evidence["source"] == "audit.json"
    assert "ALL GATES PASSED" in format_table(report)


def test_cli_exit_codes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                        capsys: pytest.CaptureFixture[str]) -> None:
    subset = tuple((n, f) for n, f in gates_pkg.GATES if n in ("termination_codes",
                                                               "train_inference_mismatch"))
    monkeypatch.setattr(gates_pkg, "GATES", subset)
    assert main(["gates", str(clean_run())]) == 3  # TIM not measured
    capsys.readouterr()
    run = copy_run(tmp_path / "run")
    edit_trace(run, "step-0000", lambda r: {**r, "termination": "infra_abort"}
               if _failed_trajectory(r) else None)
    assert main(["gates", str(run), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["failed"] == ["termination_codes"]
    assert main(["gates", str(tmp_path / "nothing")]) == 2


def test_partial_or_empty_reports_never_pass() -> None:
    assert not GateReport("x", ()).all_passed and GateReport("x", ()).exit_code == 3
    report = evaluate_gates(clean_run(), only=["termination_codes"])
    assert report.gates[0].passed is True and not report.all_passed
    assert len(report.not_evaluated) == len(GATE_NAMES) - 1 and report.exit_code == 3
