"""A run directory that cannot be fooled: a real tiny-agent run, damaged the ways a hostile
user would, then launched again. Each launch either refuses with an error naming the file or
recovers exactly (bit-identical weights, every metrics record once); none trains nothing and
ends well. The SIGKILL schedule is in tests/test_chaos.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from closedloop.cli import main
from closedloop.config import parse_config
from closedloop.contracts import TraceFormatError
from closedloop.contracts.metrics_log import VOLATILE, read_metrics
from closedloop.engine import HFGenerator
from closedloop.learn.checkpoint import load_latest
from closedloop.rollout.ledger import Ledger, LedgerCorruptError
from closedloop.training.integrity import ConfigDriftError, RunStateError
from closedloop.training.loop import train
from tests.conftest import short_run_config

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
RL_STEPS = 2


def launch(run_dir: Path, model: Path, override: str | None = None, **training: Any) -> None:
    """One in-process ``closedloop train`` launch on one thread."""
    data = short_run_config(model, RL_STEPS)
    data["training"].update(training)  # type: ignore[union-attr]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(parse_config(data), run_dir, override)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def finished(tiny_agent_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A completed 2-step run (never modified: tests work on copies)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    launch(run_dir, tiny_agent_dir)
    with Ledger(run_dir / "ledger.sqlite") as ledger:
        assert ledger.counts().consumed > 0, "the fixture run consumed nothing"
    return run_dir


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run_dir, dst, ignore=shutil.ignore_patterns("run.lock"))
    return dst


def stable_metrics(run_dir: Path) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Every metrics record by key, without its volatile fields (each key appears once)."""
    out = {}
    for r in read_metrics(run_dir / "metrics.jsonl"):
        out[(r["kind"], r.get("step"), r.get("label"))] = {
            k: v for k, v in r.items() if k not in VOLATILE}
    return out


def assert_same_final_weights(a: Path, b: Path) -> None:
    ca, cb = load_latest(a / "checkpoints"), load_latest(b / "checkpoints")
    assert ca is not None and cb is not None and ca.step == cb.step
    assert ca.consumed_group_ids == cb.consumed_group_ids
    assert all(torch.equal(v, cb.model_state[k]) for k, v in ca.model_state.items())


def test_a_finished_run_relaunched_repeats_no_record(finished: Path, tiny_agent_dir: Path,
                                                     tmp_path: Path) -> None:
    run = copy_of(finished, tmp_path)
    before = (run / "metrics.jsonl").read_text()
    launch(run, tiny_agent_dir)
    launch(run, tiny_agent_dir)
    assert (run / "metrics.jsonl").read_text() == before  # 1 eval line per label, not 3
    kinds = [r["kind"] for r in read_metrics(run / "metrics.jsonl")]
    assert kinds.count("rl_step") == kinds.count("task_draws") == RL_STEPS
    assert len((run / "launches.jsonl").read_text().splitlines()) == 3


def test_every_checkpoint_verifies_with_its_tensors_and_holds_its_version(
        finished: Path) -> None:
    """Each committed checkpoint loads in full (file hashes, the adapter's checksum as the
    commit recorded it) and holds the weights of the registry version it names."""
    from closedloop.learn.checkpoint import list_checkpoints, load_checkpoint
    from closedloop.policy.registry import PolicyRegistry

    registry = PolicyRegistry(finished / "registry")
    paths = list_checkpoints(finished / "checkpoints")
    assert paths
    for path in paths:
        ckpt = load_checkpoint(path)
        assert ckpt.optimizer_state["param_groups"], path
        manifest = registry.manifest(ckpt.output_policy_version)
        assert manifest.adapter_checksum == ckpt.model_checksum, path


def test_deleted_checkpoints_and_registry_refuse_naming_the_ledger(
        finished: Path, tiny_agent_dir: Path, tmp_path: Path) -> None:
    run = copy_of(finished, tmp_path)
    shutil.rmtree(run / "checkpoints")
    shutil.rmtree(run / "registry")
    with pytest.raises(RunStateError) as info:
        launch(run, tiny_agent_dir)
    assert info.value.path == str(run / "ledger.sqlite")
    assert "checkpoints/ holds no checkpoint" in str(info.value)
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())


def test_every_checkpoint_corrupt_refuses_naming_the_newest(finished: Path,
                                                            tiny_agent_dir: Path,
                                                            tmp_path: Path) -> None:
    run = copy_of(finished, tmp_path)
    for f in (run / "checkpoints").glob("step-*/optimizer.safetensors"):
        f.write_bytes(f.read_bytes()[::-1])
    with pytest.raises(RunStateError) as info:
        launch(run, tiny_agent_dir)
    assert info.value.path == str(run / "checkpoints" / f"step-{RL_STEPS:06d}")
    assert "does not verify" in str(info.value)
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == sorted(
        p.name for p in (finished / "checkpoints").glob("step-*"))  # nothing new written


def test_flipped_bytes_in_the_ledger_refuse(finished: Path, tiny_agent_dir: Path,
                                            tmp_path: Path) -> None:
    run = copy_of(finished, tmp_path)
    path = run / "ledger.sqlite"
    data = bytearray(path.read_bytes())
    at = data.find(b'"task_id":')  # inside a committed group's lease
    assert at > 0
    data[at + 12:at + 28] = bytes(b ^ 0x01 for b in data[at + 12:at + 28])
    path.write_bytes(bytes(data))
    with pytest.raises(LedgerCorruptError) as info:
        launch(run, tiny_agent_dir)
    assert str(path) in str(info.value)


def test_a_ledger_cut_in_half_refuses_naming_it(finished: Path, tiny_agent_dir: Path,
                                                tmp_path: Path) -> None:
    run = copy_of(finished, tmp_path)
    path = run / "ledger.sqlite"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(LedgerCorruptError) as info:
        launch(run, tiny_agent_dir)
    assert str(path) in str(info.value)


def test_a_changed_config_is_refused_and_a_declared_one_recorded(finished: Path,
                                                                 tiny_agent_dir: Path,
                                                                 tmp_path: Path) -> None:
    run = copy_of(finished, tmp_path)
    recorded = (run / "config.json").read_text()
    with pytest.raises(ConfigDriftError) as info:
        launch(run, tiny_agent_dir, learning_rate=1e-4)
    assert "training.learning_rate: 0.001 -> 0.0001" in str(info.value)
    assert (run / "config.json").read_text() == recorded
    # declared: two more RL steps, trained from the committed state and recorded
    launch(run, tiny_agent_dir, "extend the run by two steps", rl_steps=RL_STEPS + 2)
    ckpt = load_latest(run / "checkpoints")
    assert ckpt is not None and ckpt.step == RL_STEPS + 2
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "rl_step"]
    assert steps == list(range(RL_STEPS + 2))
    last = json.loads((run / "launches.jsonl").read_text().splitlines()[-1])
    assert last["config_override"] == {"reason": "extend the run by two steps", "differences":
                                       [f"training.rl_steps: {RL_STEPS} -> {RL_STEPS + 2}"]}


def test_a_step_record_lost_after_its_checkpoint_is_recovered_exactly(
        finished: Path, tiny_agent_dir: Path, tmp_path: Path) -> None:
    """A kill between the checkpoint commit and the metrics write, and a torn metrics line:
    metrics.jsonl ends inside the last step's rl_step record."""
    run = copy_of(finished, tmp_path)
    text = (run / "metrics.jsonl").read_text()
    start = text.rindex("\n", 0, text.rindex('"kind": "rl_step"')) + 1
    (run / "metrics.jsonl").write_text(text[: start + 40])  # torn inside that line
    launch(run, tiny_agent_dir)
    assert_same_final_weights(finished, run)
    assert stable_metrics(run) == stable_metrics(finished)
    with Ledger(run / "ledger.sqlite") as ledger, Ledger(finished / "ledger.sqlite") as ref:
        assert {g: ledger.get(g).state for g in ledger.group_ids()} == {
            g: ref.get(g).state for g in ref.group_ids()}


def test_a_torn_trace_line_names_the_file(finished: Path, tiny_agent_dir: Path,
                                          tmp_path: Path) -> None:
    run = copy_of(finished, tmp_path)
    trace = run / "traces" / "eval-final.jsonl"
    trace.write_bytes(trace.read_bytes()[:-30])
    with pytest.raises(TraceFormatError) as info:
        launch(run, tiny_agent_dir)
    assert info.value.path == str(trace) and "cut short" in str(info.value)


# --------------------------------------------------------------------------- the CLI
def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m closedloop.cli ARGS`` in a fresh process on one thread."""
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "closedloop.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cli_names_a_missing_config_without_a_traceback(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    proc = cli("train", str(missing), "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr
    assert f"ConfigError: config key '<file>': {missing}: cannot read" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_generator_type_error_stops_train_and_the_run_resumes_after_the_fix(
        tiny_agent_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In process (``closedloop.cli.main``, one thread): the bug propagates out of the command
    (a ``closedloop`` process exits non-zero with its traceback), nothing is recorded, and the
    fixed code resumes the same directory."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(short_run_config(tiny_agent_dir, 1)))
    run = tmp_path / "run"
    argv = ["train", str(config), "--run-dir", str(run)]

    def generate_batch(self: HFGenerator, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a bug in the generator")

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with monkeypatch.context() as patched:
            patched.setattr(HFGenerator, "generate_batch", generate_batch)
            with pytest.raises(TypeError, match="a bug in the generator"):
                main(argv)
        assert not list((run / "traces").glob("*.jsonl"))  # nothing recorded as infra_abort
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    with Ledger(run / "ledger.sqlite") as ledger:
        expected = {f"s0000-g{j}" for j in range(2)}
        report = ledger.exactly_once_report(expected)
        assert report.ok and not report.duplicate, report.counts()
    for trace in (run / "traces").glob("*.jsonl"):
        assert "infra_abort" not in trace.read_text()
