"""Every command that reads a run directory (gates, report, export, reevaluate, replay) runs the
read-only proof ``closedloop train`` runs before its first step, and stops naming the file
(closedloop.evaluate.run_integrity). Synthetic run directories keep it cheap."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest

from closedloop.cli import main
from closedloop.errors import LedgerCorruptError, MetricsFormatError, RunStateError
from closedloop.evaluate.run_integrity import verify_run_directory
from closedloop.evaluate.rundir import runs_of, verify_reading
from tests.evaluate.synthetic_run import clean_experiment, clean_run, copy_run


def _sql(run: Path, statement: str) -> None:
    conn = sqlite3.connect(run / "ledger.sqlite")
    conn.execute(statement)
    conn.commit()
    conn.close()


def test_clean_runs_and_experiments_are_proved() -> None:
    proof = verify_run_directory(clean_run())
    assert (proof.checkpoint_step, proof.ahead) == (2, 0) and proof.consumed_groups > 0
    arms = runs_of(clean_experiment())
    assert sorted(p.name for p in arms) == ["frozen", "rloo", "sft_only", "shuffled"]
    assert len(verify_reading(clean_experiment())) == 4


def _commands(run: Path, tmp_path: Path) -> dict[str, list[str]]:
    trace = sorted((run / "traces").glob("step-*.jsonl"))[0]
    return {"gates": ["gates", str(run)], "report": ["report", str(run)],
            "export": ["export", str(run), "--out", str(tmp_path / "export")],
            "reevaluate": ["reevaluate", str(run), "--attempts", "1"],
            "replay": ["replay", str(trace)]}


@pytest.mark.parametrize("command", ["gates", "report", "export", "reevaluate", "replay"])
def test_every_reading_command_refuses_a_tampered_ledger_naming_it(
        command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = copy_run(tmp_path / "run")
    _sql(run, "UPDATE groups SET task_id = task_id || '7' WHERE seq = 1")  # one character
    assert main(_commands(run, tmp_path)[command]) == 2
    err = capsys.readouterr().err
    assert "LedgerCorruptError" in err and str(run / "ledger.sqlite") in err
    assert not (run / "report.json").exists() and not (tmp_path / "export").exists()


def test_a_ledger_row_that_is_not_utf8_stops_gates_naming_the_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = copy_run(tmp_path / "run")
    _sql(run, "UPDATE events SET reason = CAST(X'c3' AS TEXT) WHERE seq = 2")
    assert main(["gates", str(run)]) == 2
    err = capsys.readouterr().err
    assert "LedgerCorruptError" in err and "events row 2" in err and "OperationalError" not in err


def test_the_proof_names_each_part_that_disagrees(tmp_path: Path) -> None:
    run = copy_run(tmp_path / "gone")
    shutil.rmtree(run / "checkpoints")  # progress whose weights are gone
    with pytest.raises(RunStateError) as info:
        verify_run_directory(run)
    assert info.value.path == str(run / "ledger.sqlite")
    run = copy_run(tmp_path / "deleted")
    (run / "ledger.sqlite").unlink()  # the checkpoint recorded the digest of its rows
    with pytest.raises(RunStateError, match="is missing"):
        verify_run_directory(run)
    run = copy_run(tmp_path / "trace")
    (run / "traces" / "step-0000.jsonl").unlink()
    with pytest.raises(RunStateError) as info:
        verify_run_directory(run)
    assert info.value.path == str(run / "traces" / "step-0000.jsonl")
    run = copy_run(tmp_path / "metrics")
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"kind": "rl_step"')  # torn
    with pytest.raises(MetricsFormatError, match=r"metrics\.jsonl"):
        verify_run_directory(run)
    run = copy_run(tmp_path / "digest")
    _sql(run, "UPDATE groups SET created_at = created_at + 1 WHERE seq = 1")
    with pytest.raises(LedgerCorruptError, match="do not match their recorded hash"):
        verify_run_directory(run)


def test_an_experiment_is_refused_when_one_arm_is_damaged(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    exp = Path(shutil.copytree(clean_experiment(), tmp_path / "exp"))
    _sql(exp / "arms" / "rloo", "UPDATE groups SET run_id = 'x' WHERE seq = 1")
    assert main(["report", str(exp)]) == 2
    assert str(exp / "arms" / "rloo" / "ledger.sqlite") in capsys.readouterr().err


def test_an_sft_only_arm_is_proved_as_one(tmp_path: Path) -> None:
    """The SFT-only control publishes v0000 and its final version with no RL checkpoint: the
    proof accepts exactly that, and refuses a version it never publishes."""
    import json

    import torch

    from closedloop.policy.registry import PolicyRegistry, version_name
    from tests.evaluate.synthetic_run import template

    arm = Path(shutil.copytree(clean_experiment() / "arms" / "sft_only", tmp_path / "sft"))
    reg = PolicyRegistry(arm / "registry")
    recorded = json.loads((arm / "config.json").read_text())
    final = recorded["config"]["training"]["rl_steps"] = 2  # as the RL arm it is matched to
    (arm / "config.json").write_text(json.dumps(recorded))

    def stage(k: int) -> None:
        staged = reg.stage({"w": torch.full((2, 2), float(k))}, template(),
                           version=version_name(k))
        reg.ack("gen-0", staged.version, staged.manifest.weight_checksum)
        reg.publish(staged.version, require_acks_from=["gen-0"])

    stage(final)
    with pytest.raises(RunStateError, match="is staged"):  # not marked SFT-only yet
        verify_run_directory(arm)
    with open(arm / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"kind": "sft_only", "step": 0, "trained_action_tokens": 40}) + "\n")
    assert verify_run_directory(arm).checkpoint_step is None
    stage(final + 3)
    with pytest.raises(RunStateError, match="publishes only v0000 and its final version"):
        verify_run_directory(arm)
