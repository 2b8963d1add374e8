"""Run every benchmark in sequence and print one summary table (``make bench``).

Each benchmark runs as its own process (``--summary`` hands its headline rows back) so one
failure does not stop the rest. The TRL comparison runs TRL only if ``.bench-venv`` exists and
says so otherwise. Ratios come from within one benchmark's process; absolute figures depend on
the machine, whose label is printed first. ``trl_multiturn`` (the multi-turn tool workload
against TRL's ``environment_factory``) is the longest: ~30-40 min on an idle 2-core host.

    .venv/bin/python benchmarks/run_all.py [--quick] [--only generation,trainer,...] [--threads 1]

``--threads`` is handed to every benchmark (torch intra-op threads, both sides of the TRL
comparison): 1 (default) is robust on a shared host; 2 uses both cores of an idle one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import machine_label  # noqa: E402

BENCHES = ("env", "precision", "generation", "rollout", "trainer", "sft", "rlstep", "async",
           "trl", "trl_multiturn", "vllm", "ray")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="every benchmark's --quick smoke")
    ap.add_argument("--only", default=",".join(BENCHES))
    ap.add_argument("--threads", type=int, default=1, help="torch threads for every benchmark")
    args = ap.parse_args()
    chosen = [b for b in args.only.split(",") if b]
    print(f"machine: {machine_label()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        summary = Path(tmp) / "summary.jsonl"
        status: dict[str, str] = {}
        for name in chosen:
            if args.quick and name == "trl_multiturn":
                # its size check needs a run's warm start (--sft-adapter DIR): a warm start small
                # enough for a check leaves every episode censored and the step unscorable
                print(f"\n=== bench_{name} ===\nskipped under --quick: run it by hand with "
                      "--quick --sft-adapter runs/smoke-<stamp>/arms/frozen/sft", flush=True)
                status[name] = "skipped under --quick: needs --sft-adapter"
                continue
            cmd = [sys.executable, str(HERE / f"bench_{name}.py")]
            if name == "env":
                cmd += ["--seconds", "0.2" if args.quick else "0.5"]
            else:
                cmd += ["--threads", str(args.threads)]
                cmd += ["--summary", str(summary)] + (["--quick"] if args.quick else [])
            print(f"\n=== bench_{name} ===", flush=True)
            t0 = time.perf_counter()
            rc = subprocess.run(cmd, check=False).returncode
            status[name] = f"rc {rc}, {time.perf_counter() - t0:.0f}s"
        rows = [json.loads(line) for line in summary.read_text().splitlines()] \
            if summary.is_file() else []
    print("\n=== summary ===")
    print(f"machine: {machine_label('at the end')}; benchmarks ran with --threads {args.threads}")
    print(f"{'benchmark':11s} {'measure':42s} {'value':>12s}  target")
    for r in rows:
        value = f"{r['value']} {r['unit']}".strip()
        print(f"{r['bench']:11s} {r['name']:42s} {value:>12s}  {r['target']}")
    print("runs: " + ", ".join(f"{k} ({v})" for k, v in status.items()))


if __name__ == "__main__":
    main()
