"""Benchmark (not a test): what each matmul precision costs on this host, and what the precision
policy picks.

Prints the host's CPU facts and the policy's resolution of ``auto`` (``closedloop.engine.
host_precision``), then, measured side by side in this one process:

- a bare square GEMM (``--sizes``, default 256 512 1024) in float32 and in bfloat16, GFLOP/s
  (best of ``--repeats``; 2·n³ operations), and bf16's speed relative to float32;
- one warm-start step's forward+backward (``closedloop.learn.sft.sft_backward`` on the noisy
  expert's demonstrations, the embedded model with the run's LoRA adapter; ``--quick``: the tiny
  random model) at the resolved precision and in float32, alternated in rotated order: the
  headline is resolved seconds over float32 seconds (on a host without native bf16 ``auto``
  is float32, so the two are the same work and the ratio is ~1).

With ``--force-bf16`` the step is also timed under bfloat16 whatever the host (on an AVX2 CPU
this is the slowdown a forced bf16 run would pay; slow: minutes per step with the real model).

Whenever bf16 is timed (resolved on a native-bf16 host, or forced), the same step is also timed
with one bf16 input cast per Linear instead of one shared by the Linears that read the same
input (``matmul_precision(..., share_input_casts=False)``, the rule before sharing): the ratio
is what sharing saves (bit-identical results; on an emulated-bf16 host the emulated GEMMs
swamp it).

    .venv/bin/python benchmarks/bench_precision.py [--sizes 256 512 1024] [--repeats 3]
        [--episodes 4] [--force-bf16] [--threads 1] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine_label, median, rotate, set_threads
from bench_sft import collect_demonstrations, lora_model

from closedloop.config import SFTSection
from closedloop.engine import (
    matmul_precision,
    measure_matmul_rates,
    read_cpu_facts,
    resolve_precision,
)
from closedloop.learn.sft import sft_backward
from closedloop.policy import load_tokenizer


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--episodes", type=int, default=4)
    ap.add_argument("--force-bf16", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="tiny random model (smoke only)")
    ap.add_argument("--summary")
    args = ap.parse_args(argv)
    set_threads(args.threads)
    print(f"[precision] machine: {machine_label()}")
    facts = read_cpu_facts()
    print(f"[precision] cpu: {facts.arch}, bf16-relevant flags {facts.bf16_flags()} "
          f"(from {facts.source})")
    choice = resolve_precision("auto", facts)
    print(f"[precision] auto resolves to {choice.describe()}")
    for size in args.sizes:
        rates = measure_matmul_rates(size, args.repeats)
        print(f"[precision] GEMM {size}²: float32 {rates.float32_gflops:8.1f} GFLOP/s, "
              f"bfloat16 {rates.bfloat16_gflops:8.1f} GFLOP/s, bf16/fp32 "
              f"{rates.bf16_speedup:.3f}")
        emit(args.summary, "precision", f"GEMM {size} bf16/fp32 rate", round(rates.bf16_speedup, 3))
    tokenizer = load_tokenizer()
    demos = collect_demonstrations(args.episodes, 8, tokenizer, SFTSection().noise_rate)
    model = lora_model(args.quick, tokenizer)
    pad_id = int(tokenizer.pad_token_id or 0)
    modes = {"resolved": (choice.precision, True), "float32": ("float32", True)}
    if args.force_bf16:
        modes["bfloat16"] = ("bfloat16", True)
    if any(p == "bfloat16" for p, _ in modes.values()):
        modes["bfloat16, a cast per Linear"] = ("bfloat16", False)
    secs: dict[str, list[float]] = {m: [] for m in modes}
    for precision, share in modes.values():  # untimed warm-up
        with matmul_precision(model, precision, share_input_casts=share):
            sft_backward(model, demos, pad_id, 8)
    for rep in range(args.repeats):
        for name in rotate(list(modes), rep):
            precision, share = modes[name]
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            with matmul_precision(model, precision, share_input_casts=share):
                sft_backward(model, demos, pad_id, 8)
            secs[name].append(time.perf_counter() - t0)
    for name, values in secs.items():
        print(f"[precision] warm-start step ({len(demos)} episodes, {name}): "
              f"median {median(values):.2f}s of {[round(v, 2) for v in values]}")
    ratio = median([r / f for r, f in zip(secs["resolved"], secs["float32"], strict=True)])
    print(f"[precision] headline: warm-start step at the resolved precision "
          f"({choice.precision}) / float32 = {ratio:.2f} (target <= 1.5)")
    emit(args.summary, "precision", "warm-start step resolved/fp32", round(ratio, 2), "x",
         "<= 1.5")
    if "bfloat16" in secs:
        forced = median([b / f for b, f in zip(secs["bfloat16"], secs["float32"], strict=True)])
        print(f"[precision] forced bfloat16 / float32 = {forced:.2f}")
    per_linear = secs.get("bfloat16, a cast per Linear")
    if per_linear:
        shared = secs["bfloat16"] if "bfloat16" in secs else secs["resolved"]
        gain = median([a / b for a, b in zip(per_linear, shared, strict=True)])
        print(f"[precision] bf16 input casts: a cast per Linear / shared = {gain:.3f}"
              + ("" if choice.precision == "bfloat16" else " (emulated bf16: not a figure a "
                 "user would see)"))
        emit(args.summary, "precision", "bf16 per-Linear casts / shared casts",
             round(gain, 3), "x")
    print(f"[precision] machine: {machine_label('at the end')}")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
