"""Atomic trainer checkpoints: round trip, pruning, corruption, and SIGKILL recovery.

The crash tests run this file as a script (``_child_main``): a toy trainer whose "model" is a
vector counting how often each group was applied. After every crash the newest complete
checkpoint must hold exactly the groups it says it consumed, once each, and the ledger
reconciled with it must agree; after the final run every group is applied exactly once.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from closedloop.contracts import GroupLease, sha256_hex
from closedloop.learn.checkpoint import (
    PAUSE_ENV,
    CheckpointError,
    CheckpointExistsError,
    capture_rng_states,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    restore_rng_states,
    save_checkpoint,
)
from closedloop.policy.registry import version_name
from closedloop.rollout.ledger import GroupSummary, Ledger, ReconcileReport

N_GROUPS, BATCH = 16, 2


def _save(root: Path, step: int, **kw: object) -> Path:
    ids = kw.pop("ids", [f"g{i}" for i in range(step)])
    return save_checkpoint(
        root, step, {"w": torch.full((3,), float(step))}, {"s": step}, version_name(step), ids, **kw
    )  # type: ignore[arg-type]


def test_round_trip_with_real_optimizer_and_rng(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    rng = capture_rng_states()
    path = save_checkpoint(
        tmp_path,
        7,
        model.state_dict(),
        opt.state_dict(),
        "v0007",
        ["b", "a", "a"],
        rng,
        extra={"note": "x"},
    )
    assert path.name == "step-000007"
    ck = load_latest(tmp_path)
    assert ck is not None and ck.path == path
    assert (ck.step, ck.output_policy_version, ck.extra) == (7, "v0007", {"note": "x"})
    assert ck.consumed_group_ids == frozenset({"a", "b"})
    assert all(torch.equal(ck.model_state[k], v) for k, v in model.state_dict().items())
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    fresh.load_state_dict(ck.optimizer_state)
    assert torch.equal(
        fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]
    )
    expected = (random.random(), float(np.random.rand()), torch.rand(1).item())
    restore_rng_states(ck.rng_states)
    assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == expected
    assert (tmp_path / "LATEST").read_text().count("step-000007") == 1


def test_a_v1_checkpoint_with_a_pickled_optimizer_still_loads(tmp_path: Path) -> None:
    """Checkpoints written before the optimizer's state was stored flat (format v1,
    ``optimizer.pt`` by torch.save) resume as before."""
    import hashlib
    import io
    import json

    from closedloop.contracts.hashing import canonical_json, content_hash

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    path = save_checkpoint(tmp_path, 4, model.state_dict(), opt.state_dict(), "v0004", ["g"])
    manifest = json.loads((path / "checkpoint.json").read_text())
    (path / "optimizer.safetensors").unlink()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    (path / "optimizer.pt").write_bytes(buf.getvalue())
    files = dict(manifest["files"])
    del files["optimizer.safetensors"]
    files["optimizer.pt"] = "sha256:" + hashlib.sha256(buf.getvalue()).hexdigest()
    body = {k: v for k, v in manifest.items() if k != "self_hash"}
    body.update(format="closedloop-checkpoint-v1", files=files)
    (path / "checkpoint.json").write_text(canonical_json({**body,
                                                           "self_hash": content_hash(body)}))
    ck = load_checkpoint(path)
    assert torch.equal(ck.optimizer_state["state"][0]["exp_avg"],
                       opt.state_dict()["state"][0]["exp_avg"])
    # a v2 file list under a v1 format (or the reverse) is refused
    body["files"] = manifest["files"]
    (path / "checkpoint.json").write_text(canonical_json({**body,
                                                           "self_hash": content_hash(body)}))
    with pytest.raises(CheckpointError, match="unexpected file list"):
        load_checkpoint(path)


def test_named_generators_round_trip_with_the_global_rngs(tmp_path: Path) -> None:
    sampler = torch.Generator().manual_seed(5)
    torch.rand(3, generator=sampler)
    _save(tmp_path, 1, rng_states=capture_rng_states({"sampler": sampler}))
    ck = load_latest(tmp_path)
    assert ck is not None
    expected = (torch.rand(2, generator=sampler).tolist(), float(np.random.rand()))
    other = torch.Generator().manual_seed(99)
    restore_rng_states(ck.rng_states, {"sampler": other})
    assert (torch.rand(2, generator=other).tolist(), float(np.random.rand())) == expected
    with pytest.raises(CheckpointError, match="'missing' generator"):
        restore_rng_states(ck.rng_states, {"missing": torch.Generator()})


def test_keep_last_and_refusals(tmp_path: Path) -> None:
    for step in range(1, 6):
        _save(tmp_path, step, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000004", "step-000005"]
    with pytest.raises(CheckpointExistsError):
        _save(tmp_path, 5)
    with pytest.raises(CheckpointExistsError):
        _save(tmp_path, 3)
    with pytest.raises(CheckpointError):
        save_checkpoint(tmp_path, -1, {}, {}, "v0000", [])
    assert load_latest(tmp_path / "missing") is None


def test_payloads_of_every_size_load_exactly(tmp_path: Path) -> None:
    """Files are written in whole blocks and cut to their length (``write_uncached``): longer
    and shorter payloads than the last, and empty ones, load as saved."""
    sizes = [5, 300, 2, 1100, 1, 0, 17]
    for step, n in enumerate(sizes, start=1):
        save_checkpoint(tmp_path, step, {"w": torch.arange(float(n + 1)) + step},
                        {"s": "x" * n}, version_name(step), [f"g{i}" for i in range(n)],
                        keep_last=2)
        for kept in list_checkpoints(tmp_path):
            ck = load_checkpoint(kept)
            k = ck.step
            assert torch.equal(ck.model_state["w"], torch.arange(float(sizes[k - 1] + 1)) + k)
            assert ck.optimizer_state == {"s": "x" * sizes[k - 1]}
            assert ck.consumed_group_ids == {f"g{i}" for i in range(sizes[k - 1])}
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000006", "step-000007"]


def test_a_save_that_fails_midway_leaves_the_kept_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from closedloop.learn import checkpoint as module

    for step in range(1, 4):
        _save(tmp_path, step, keep_last=2)
    real, calls = module.write_uncached, []

    def fail_second(path: Path, data: bytes) -> bool:
        calls.append(path.name)
        real(path, data)
        if len(calls) == 2:
            raise OSError("disk full")
        return True

    monkeypatch.setattr(module, "write_uncached", fail_second)
    with pytest.raises(OSError):
        _save(tmp_path, 4, keep_last=2)
    monkeypatch.undo()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000002", "step-000003"]
    assert load_latest(tmp_path).step == 3  # type: ignore[union-attr]
    _save(tmp_path, 4, keep_last=2)
    assert load_latest(tmp_path).step == 4  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "damage", ["flip_model_byte", "drop_rng", "edit_manifest", "truncate_manifest"]
)
def test_corrupt_newest_falls_back_to_previous(tmp_path: Path, damage: str) -> None:
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    if damage == "flip_model_byte":
        raw = bytearray((newest / "model.safetensors").read_bytes())
        raw[-1] ^= 0x01
        (newest / "model.safetensors").write_bytes(bytes(raw))
    elif damage == "drop_rng":
        (newest / "rng.pt").unlink()
    elif damage == "edit_manifest":
        text = (newest / "checkpoint.json").read_text()
        (newest / "checkpoint.json").write_text(text.replace('"g1"', '"g9"'))
    else:
        (newest / "checkpoint.json").write_text("{")
    ck = load_latest(tmp_path)
    assert ck is not None and ck.step == 1 and ck.consumed_group_ids == {"g0"}
    _save(tmp_path, 2)  # the corrupt directory is moved aside, not an obstacle
    assert load_latest(tmp_path).step == 2  # type: ignore[union-attr]


def test_partial_temp_dir_is_never_loaded(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    partial = tmp_path / ".tmp-step-000002-crashed"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    assert load_latest(tmp_path).step == 1  # type: ignore[union-attr]
    _save(tmp_path, 2)
    assert not partial.exists()
    assert load_checkpoint(tmp_path / "step-000002").step == 2


# ----------------------------------------------------------------------------- crash tests
def _child_main(workdir: str, crash_at: str) -> None:
    """A toy trainer: apply admitted groups two at a time, checkpoint, then mark the ledger.

    ``crash_at`` names the point of the first step of this run where it SIGKILLs itself.
    """
    root = Path(workdir)
    ledger = Ledger(root / "ledger.sqlite")
    ck = load_latest(root / "ckpt")
    acc = ck.model_state["acc"].clone() if ck else torch.zeros(N_GROUPS)
    consumed = set(ck.consumed_group_ids) if ck else set()
    step = ck.step if ck else 0
    ledger.reconcile_with_checkpoint(consumed, step, version_name(step))
    print("ready", flush=True)
    while batch := ledger.group_ids("admitted")[:BATCH]:
        ledger.require_admitted(batch)
        for gid in batch:
            acc[int(gid[1:])] += 1.0  # the "update": count applications per group
        step += 1
        consumed |= set(batch)
        _maybe_crash(crash_at, "before_checkpoint")
        save_checkpoint(
            root / "ckpt",
            step,
            {"acc": acc},
            {"step": torch.tensor(step)},
            version_name(step),
            consumed,
            keep_last=2,
        )
        _maybe_crash(crash_at, "after_checkpoint")
        ledger.mark_consumed(batch, step, version_name(step))
        _maybe_crash(crash_at, "after_ledger")


def _maybe_crash(crash_at: str, point: str) -> None:
    if crash_at == point:
        os.kill(os.getpid(), signal.SIGKILL)


def _spawn(workdir: Path, crash_at: str = "none", pause_s: float = 0.0) -> subprocess.Popen:
    env = {**os.environ, PAUSE_ENV: str(pause_s)}
    return subprocess.Popen(
        [sys.executable, __file__, str(workdir), crash_at],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _check_consistent(workdir: Path) -> tuple[frozenset[str], ReconcileReport | None]:
    """The newest complete checkpoint applied each of its groups exactly once; after
    reconciliation the ledger's consumed set is exactly the checkpoint's."""
    ck = load_latest(workdir / "ckpt")
    if ck is None:
        return frozenset(), None
    expected = torch.zeros(N_GROUPS)
    for gid in ck.consumed_group_ids:
        expected[int(gid[1:])] = 1.0
    assert torch.equal(ck.model_state["acc"], expected), (ck.step, ck.model_state["acc"])
    assert len(ck.consumed_group_ids) == BATCH * ck.step
    assert ck.output_policy_version == version_name(ck.step)
    assert int(ck.optimizer_state["step"]) == ck.step
    with Ledger(workdir / "ledger.sqlite") as ledger:
        report = ledger.reconcile_with_checkpoint(ck.consumed_group_ids, ck.step)
        assert set(ledger.group_ids("consumed")) == ck.consumed_group_ids
    return ck.consumed_group_ids, report


def _run_to_crash(workdir: Path, crash_at: str) -> None:
    proc = _spawn(workdir, crash_at)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err


@pytest.mark.slow
def test_sigkill_recovery_gives_exactly_once(tmp_path: Path) -> None:
    ids = [f"g{i}" for i in range(N_GROUPS)]
    h = sha256_hex("x")
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        for gid in ids:
            ledger.record_collected(
                GroupLease(gid, "run", "task", 1, "snap", h, "v0000", h, 4),
                GroupSummary(n_trajectories=4),
            )
            ledger.admit(gid)
    # Deterministic crash points, one step each.
    _run_to_crash(tmp_path, "before_checkpoint")
    assert _check_consistent(tmp_path)[0] == frozenset()
    _run_to_crash(tmp_path, "after_checkpoint")
    done, report = _check_consistent(tmp_path)
    assert report is not None and set(report.marked_consumed) == done == {"g0", "g1"}
    _run_to_crash(tmp_path, "after_ledger")
    done, report = _check_consistent(tmp_path)
    assert report is not None and report.marked_consumed == () and len(done) == 4
    # SIGKILL at random moments while checkpoints are being written (slowed by the pause).
    rng = random.Random(1234)
    interrupted_writes = 0
    for _ in range(4):
        with _spawn(tmp_path, pause_s=0.03) as proc:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
            try:
                proc.wait(timeout=rng.uniform(0.05, 0.3))
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                proc.communicate(timeout=60)
        ckdir = tmp_path / "ckpt"
        interrupted_writes += any(p.name.startswith(".tmp-") for p in ckdir.iterdir())
        _check_consistent(tmp_path)
    assert interrupted_writes >= 1
    # The newest checkpoint is lost to corruption: fall back, revert, re-apply once.
    newest = list_checkpoints(tmp_path / "ckpt")[-1]
    (newest / "model.safetensors").write_bytes(b"rot")
    proc = _spawn(tmp_path)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    done, _ = _check_consistent(tmp_path)
    assert done == set(ids)
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        eo = ledger.exactly_once_report(ids)
        assert eo.ok and eo.consumed_once == tuple(sorted(ids)) and eo.duplicate_attempts == 0
        assert ledger.counts().reverted_by_reconcile >= 1


if __name__ == "__main__":
    _child_main(sys.argv[1], sys.argv[2])


def test_a_model_checksum_handed_in_is_the_one_load_verifies(tmp_path: Path) -> None:
    from closedloop.policy.weights import state_dict_checksum

    state = {"w": torch.arange(6.0)}
    save_checkpoint(tmp_path, 1, state, {}, "v0001", [], model_checksum=state_dict_checksum(
        state))
    assert load_checkpoint(tmp_path / "step-000001").model_checksum == state_dict_checksum(state)
    save_checkpoint(tmp_path, 2, state, {}, "v0002", [], model_checksum="sha256:" + "0" * 64)
    with pytest.raises(CheckpointError, match="model checksum mismatch"):
        load_checkpoint(tmp_path / "step-000002")
