"""The run directory as a checked whole (closedloop.training.integrity), on real checkpoint, ledger,
registry and metrics files: config drift, the lock, and the agreement of the parts.

The end-to-end cases (a real tiny-agent run corrupted, then relaunched) are in
tests/test_run_directory.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from closedloop.contracts.metrics_log import MetricsLog
from closedloop.learn.checkpoint import save_checkpoint
from closedloop.policy.registry import version_name
from closedloop.rollout.ledger import Ledger
from closedloop.training.integrity import (
    ConfigDriftError,
    RunLock,
    RunLockedError,
    RunProgress,
    RunStateError,
    check_agreement,
    check_config,
    config_differences,
    prove_state,
    survey_checkpoints,
)
from tests.rollout.test_ledger import admitted

CONFIG = {"training": {"learning_rate": 1e-3, "rl_steps": 4}, "model": "m"}
META = {"config_hash": "h", "git_revision": "r", "versions": {}}


def test_config_differences_name_every_changed_key() -> None:
    new = {"training": {"learning_rate": 1e-4, "rl_steps": 4, "seed": 1}, "model": "m"}
    assert config_differences(CONFIG, new) == [
        "training.learning_rate: 0.001 -> 0.0001", "training.seed: (absent) -> 1"]
    assert config_differences(CONFIG, json.loads(json.dumps(CONFIG))) == []
    assert config_differences({"a": 1}, {"a": 1.0}) == ["a: 1 -> 1.0"]


def test_config_drift_is_refused_unless_declared_and_the_override_is_recorded(
        tmp_path: Path) -> None:
    check_config(tmp_path, CONFIG, META)
    recorded = (tmp_path / "config.json").read_text()
    (tmp_path / "metrics.jsonl").write_text('{"kind": "sft", "step": 0}\n')  # work was done
    check_config(tmp_path, CONFIG, META)  # the same config: accepted, nothing rewritten
    changed = {**CONFIG, "training": {"learning_rate": 1e-4, "rl_steps": 8}}
    with pytest.raises(ConfigDriftError) as info:
        check_config(tmp_path, changed, META)
    message = str(info.value)
    assert "config.json" in message and "training.learning_rate: 0.001 -> 0.0001" in message
    assert "training.rl_steps: 4 -> 8" in message and "--override-config" in message
    assert (tmp_path / "config.json").read_text() == recorded  # never overwritten silently
    accepted = check_config(tmp_path, changed, META, override="longer run, lower lr")
    assert len(accepted) == 2
    assert json.loads((tmp_path / "config.json").read_text())["config"] == changed
    launches = [json.loads(x) for x in (tmp_path / "launches.jsonl").read_text().splitlines()]
    assert [x["config_override"] for x in launches[:2]] == [None, None]
    assert launches[2]["config_override"] == {"reason": "longer run, lower lr",
                                              "differences": accepted}
    assert len(launches) == 3  # the refused launch left no line
    check_config(tmp_path, changed, META)  # the new config is now the recorded one


def test_a_relaunch_after_a_launch_that_did_no_work_takes_the_new_config(
        tmp_path: Path) -> None:
    """A first launch that stopped during set-up (a factory that failed, a failed package
    check) left config.json and tasks.json but no work: a fixed relaunch with another config
    is a first launch again (the reason recorded), not config drift; once work exists, it is."""
    from closedloop.training.integrity import check_tasks

    check_config(tmp_path, CONFIG, META)
    (tmp_path / "tasks.json").write_text(json.dumps({"train": ["a"], "heldout": ["b"]}))
    for sub in ("traces", "checkpoints", "sft"):
        (tmp_path / sub).mkdir()  # made by every launch before its set-up
    Ledger(tmp_path / "ledger.sqlite").close()  # an empty ledger is no work either
    fixed = {**CONFIG, "model": "fixed"}
    assert check_config(tmp_path, fixed, META) == ["model: \"m\" -> \"fixed\""]
    launch = json.loads((tmp_path / "launches.jsonl").read_text().splitlines()[-1])
    assert "before its first piece of work" in launch["config_override"]["reason"]
    recorded = (tmp_path / "tasks.json").read_bytes()
    check_tasks(tmp_path / "tasks.json", recorded, {"train": ["c"], "heldout": ["b"]}, None)
    (tmp_path / "traces" / "step-0000.jsonl").write_text("")  # work: now drift is refused
    with pytest.raises(ConfigDriftError):
        check_config(tmp_path, CONFIG, META)
    with pytest.raises(ConfigDriftError, match="train task ids"):
        check_tasks(tmp_path / "tasks.json", recorded, {"train": ["c"], "heldout": ["b"]},
                    None)


def test_an_unreadable_recorded_config_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"config": ')
    with pytest.raises(ConfigDriftError, match="cannot read the recorded config"):
        check_config(tmp_path, CONFIG, META)


def test_one_launch_at_a_time(tmp_path: Path) -> None:
    first = RunLock(tmp_path)
    with pytest.raises(RunLockedError, match="another launch"):
        RunLock(tmp_path)
    first.release()
    RunLock(tmp_path).release()


# --------------------------------------------------------------------------- agreement
def _ckpt(root: Path, step: int, consumed: list[str], digest: dict | None = None) -> Path:
    extra = {"ledger_digest": digest} if digest else {}
    return save_checkpoint(root / "checkpoints", step, {"w": torch.full((2,), float(step))},
                           {}, version_name(step), consumed, extra=extra)


def _stage(root: Path, *indices: int) -> list[str]:
    for i in indices:
        (root / "registry" / "versions" / version_name(i)).mkdir(parents=True, exist_ok=True)
    return [version_name(i) for i in indices]


def _run(tmp_path: Path, steps: int) -> tuple[Ledger, MetricsLog]:
    """A run directory after ``steps`` RL steps of one group each, in protocol order."""
    (tmp_path / "traces").mkdir(exist_ok=True)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    metrics = MetricsLog(tmp_path / "metrics.jsonl")
    _ckpt(tmp_path, 0, [])
    consumed: list[str] = []
    for s in range(steps):
        gid = f"s{s:04d}-g0"
        (tmp_path / "traces" / f"step-{s:04d}.jsonl").write_text("")
        admitted(ledger, gid)
        consumed.append(gid)
        _ckpt(tmp_path, s + 1, consumed, ledger.digest().to_dict())
        ledger.mark_consumed([gid], s + 1, version_name(s + 1))
        metrics.put({"kind": "rl_step", "step": s})
    _stage(tmp_path, *range(steps + 1))
    return ledger, metrics


def _prove(tmp_path: Path, ledger: Ledger, metrics: MetricsLog) -> tuple[int | None, int]:
    folder = tmp_path / "registry" / "versions"
    versions = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    ckpt, ahead = prove_state(tmp_path, ledger, versions, metrics)
    return (None if ckpt is None else ckpt.step), ahead


def test_a_consistent_run_resumes_at_its_newest_checkpoint(tmp_path: Path) -> None:
    ledger, metrics = _run(tmp_path, 3)
    assert _prove(tmp_path, ledger, metrics) == (3, 0)


def test_a_lost_step_record_reruns_that_step_from_the_previous_checkpoint(
        tmp_path: Path) -> None:
    ledger, _ = _run(tmp_path, 3)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n")  # step 2's lost
    assert _prove(tmp_path, ledger, MetricsLog(tmp_path / "metrics.jsonl")) == (2, 1)
    assert not (tmp_path / "checkpoints" / "step-000003").exists()  # set aside


def test_deleted_checkpoints_and_registry_are_refused_naming_the_ledger(tmp_path: Path) -> None:
    ledger, metrics = _run(tmp_path, 3)
    import shutil

    for sub in ("checkpoints", "registry"):
        shutil.rmtree(tmp_path / sub)
    with pytest.raises(RunStateError) as info:
        _prove(tmp_path, ledger, metrics)
    assert "ledger.sqlite" in str(info.value) and "consumed at step 3" in str(info.value)
    assert "no checkpoint" in str(info.value)


def test_every_checkpoint_corrupt_is_refused_naming_the_newest(tmp_path: Path) -> None:
    ledger, metrics = _run(tmp_path, 3)
    for path in (tmp_path / "checkpoints").glob("step-*/model.safetensors"):
        path.write_bytes(b"damaged")
    with pytest.raises(RunStateError) as info:
        _prove(tmp_path, ledger, metrics)
    assert "step-000003: does not verify" in str(info.value)


def test_a_corrupt_newest_checkpoint_with_progress_past_the_older_one_is_refused(
        tmp_path: Path) -> None:
    ledger, metrics = _run(tmp_path, 3)
    (tmp_path / "checkpoints" / "step-000003" / "rng.pt").unlink()
    with pytest.raises(RunStateError, match="step-000003: does not verify"):
        _prove(tmp_path, ledger, metrics)


def test_missing_registry_versions_traces_and_records_are_named(tmp_path: Path) -> None:
    ledger, metrics = _run(tmp_path, 3)
    (tmp_path / "registry" / "versions" / "v0001").rmdir()
    with pytest.raises(RunStateError, match=r"versions/v0001: is missing"):
        _prove(tmp_path, ledger, metrics)
    _stage(tmp_path, 1)
    (tmp_path / "traces" / "step-0001.jsonl").unlink()
    with pytest.raises(RunStateError, match=r"step-0001\.jsonl: is missing"):
        _prove(tmp_path, ledger, metrics)
    (tmp_path / "traces" / "step-0001.jsonl").write_text("")
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "metrics.jsonl").write_text(lines[0] + "\n" + lines[2] + "\n")
    with pytest.raises(RunStateError, match="no rl_step record of step 1"):
        _prove(tmp_path, ledger, MetricsLog(tmp_path / "metrics.jsonl"))


def test_a_new_run_must_show_no_progress(tmp_path: Path) -> None:
    survey = survey_checkpoints(tmp_path / "checkpoints")
    check_agreement(tmp_path, survey, RunProgress((), ("v0000",), (), ()))
    for progress, what in ((RunProgress((1,), (), (), ()), "ledger.sqlite"),
                           (RunProgress((), ("v0000", "v0001"), (), ()), "v0001"),
                           (RunProgress((), (), (0,), ()), "metrics.jsonl")):
        with pytest.raises(RunStateError, match=what):
            check_agreement(tmp_path, survey, progress)


def test_a_tampered_ledger_is_refused_against_the_checkpoint_digest(tmp_path: Path) -> None:
    import sqlite3

    ledger, metrics = _run(tmp_path, 2)
    ledger.close()
    conn = sqlite3.connect(tmp_path / "ledger.sqlite")
    conn.execute("UPDATE groups SET summary_json='{\"n_trajectories\": 9}' WHERE seq=1")
    conn.commit()
    conn.close()
    from closedloop.rollout.ledger import LedgerCorruptError

    with Ledger(tmp_path / "ledger.sqlite") as reopened, pytest.raises(
            LedgerCorruptError, match=r"ledger\.sqlite: groups"):
        _prove(tmp_path, reopened, metrics)


def test_the_run_seeds_python_numpy_and_torch() -> None:
    import random

    import numpy as np

    from closedloop.training.run import _seed_all

    def draws() -> tuple[float, float, float]:
        return random.random(), float(np.random.rand()), float(torch.rand(1))

    _seed_all(7)
    first = draws()
    _seed_all(7)
    assert draws() == first
    _seed_all(8)
    assert all(a != b for a, b in zip(draws(), first, strict=True))


def test_a_damaged_warm_start_names_its_file(tmp_path: Path) -> None:
    from closedloop.training.warm_start import load_warm_start

    sft = tmp_path / "sft"
    sft.mkdir()
    torch.save({"w": torch.ones(2)}, sft / "adapter.pt")
    (sft / "result.json").write_text('{"trained_action_tokens": 12}')
    state, tokens = load_warm_start(sft)
    assert tokens == 12 and torch.equal(state["w"], torch.ones(2))
    (sft / "result.json").write_text('{"trained_action')  # torn
    with pytest.raises(RunStateError, match=r"result\.json.*unreadable.*To recover: delete"):
        load_warm_start(sft)
    (sft / "result.json").write_text('{"trained_action_tokens": 12}')
    (sft / "adapter.pt").write_bytes(b"\x80\x02garbage")
    with pytest.raises(RunStateError, match=r"adapter\.pt.*does not load"):
        load_warm_start(sft)
    (sft / "result.json").unlink()
    with pytest.raises(RunStateError, match=r"result\.json"):
        load_warm_start(sft)
