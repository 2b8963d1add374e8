"""The benchmarks' own quick checks run: ``bench_trl.py --tiny`` drives the real ``rl_step`` (every
contract on) on a random tiny model, ``bench_rlstep.py --quick`` on the tests' tiny agent, in
seconds each. Both stopped working unnoticed once (every episode ran to the token budget, so the
step stopped as unscorable); these keep them honest.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_trl_tiny_check_runs_the_real_step(tmp_path: Path) -> None:
    summary = tmp_path / "summary.jsonl"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_trl.py"), "--tiny", "--no-trl",
         "--precision", "float32", "--steps", "2", "--summary", str(summary)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["name"]: r for r in map(json.loads, summary.read_text().splitlines())}
    step = rows["ours s/real rl_step, float32"]["value"]
    assert math.isfinite(step) and step > 0
    for name in ("bookkeeping share of the step, float32",
                 "bookkeeping share of all steps' wall time, float32"):
        assert 0 < rows[name]["value"] < 100
    assert "trained on 0 " not in proc.stdout  # the update ran on scored episodes


def test_bench_rlstep_quick_check_makes_an_update(tmp_path: Path) -> None:
    """``bench_rlstep.py --quick`` runs one real step with an update on the tests' tiny agent
    (the raw embedded model at its old quick sizes left every episode censored)."""
    summary = tmp_path / "summary.jsonl"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_rlstep.py"), "--quick",
         "--summary", str(summary)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["name"]: r["value"] for r in map(json.loads, summary.read_text().splitlines())}
    assert rows["step with an update: wall"] > 0
    assert "no step of" not in proc.stdout  # a step made an update
