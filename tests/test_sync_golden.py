"""The synchronous path is unchanged by the split into roles: a short tiny-agent run (warm
start, start evaluations and audit, 2 RL steps, final evaluations) gives the traces, ledger,
metrics and adapter of ``tests/golden/sync_run.json``, written from the code before the split
(``tests.golden_run``), or of this host's own fingerprint where its kernels round differently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from closedloop.config import parse_config
from closedloop.engine import NATIVE_ENV
from closedloop.training.loop import train
from tests.golden_run import (
    GOLDEN,
    differences,
    fingerprint,
    golden_config,
    golden_for_host,
    weight_hash_paths,
    weight_hash_pattern,
)

pytestmark = pytest.mark.slow  # ~25 s: a whole run (warm start, 4 evaluations, 2 RL steps)


def test_sync_run_reproduces_the_golden_fingerprint(tiny_agent_dir: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NATIVE_ENV, "0")  # torch's kernels only (tests.golden_run)
    golden = json.loads(golden_for_host().read_text())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(parse_config(golden_config(tiny_agent_dir)), tmp_path / "run")
    finally:
        torch.set_num_threads(threads)
    now = fingerprint(tmp_path / "run")
    golden = {k: v for k, v in golden.items() if k != "torch"}
    paths = weight_hash_paths(golden)
    diffs = differences(weight_hash_pattern(golden, paths), weight_hash_pattern(now, paths))
    assert not diffs, "the synchronous run departs from its golden:\n" + "\n".join(diffs[:20])


def test_the_comparison_can_fail() -> None:
    golden = json.loads(GOLDEN.read_text())
    changed = json.loads(GOLDEN.read_text())
    first = next(iter(changed["traces"]["step-0000.jsonl"]))
    first["actions"] = "sha256:" + "0" * 64
    changed["metrics"]['["rl_step", 1, null]']["metrics"]["losses/loss"] *= 1.01
    del changed["ledger"]["s0000-g0"]
    diffs = differences(golden, changed)
    assert len(diffs) == 3, diffs


def test_the_weight_hashes_compare_by_their_pattern() -> None:
    """Other bits of every weight hash pass, and so do records the golden lacks; an evaluation
    that saw other weights than its golden's (the final suite evaluated on the start policy)
    fails."""
    golden = json.loads(GOLDEN.read_text())
    paths = weight_hash_paths(golden)
    assert len(paths) == 5

    def compared(run: dict) -> list[str]:
        return differences(weight_hash_pattern(golden, paths), weight_hash_pattern(run, paths))

    rebits = json.loads(GOLDEN.read_text())
    for record in rebits["metrics"].values():
        for key in ("weight_checksum", "manifest_hash"):
            if key in record:
                record[key] = record[key][:-8] + "00000000"
    rebits["metrics"]['["aaa_new", 0, null]'] = {"manifest_hash": "sha256:" + "1" * 64}
    assert compared(rebits) == []
    wrong = json.loads(GOLDEN.read_text())
    metrics = wrong["metrics"]
    metrics['["eval", null, "final"]']["manifest_hash"] = (
        metrics['["eval", null, "start"]']["manifest_hash"])
    diffs = compared(wrong)
    assert diffs and all("/manifest_hash" in d for d in diffs), diffs
