"""Benchmark (not a test): multi-turn rollout generation through ``HFGenerator`` (issue 3).

Eight modes on the embedded model (fp32 weights), each producing 8-turn episodes of a fixed shape:
a ~200-token prompt, then per turn exactly ``--action`` (24) sampled action ids (no stop token,
no stop sequence, so every action runs to ``max_new_tokens``) and ``--obs`` (40) fixed
observation ids appended with ``extend``:

- ``kv_batched``: G=8 sibling sessions stepped together, KV cache reused across turns (ours:
  the generator's default decode copy, ``llama_decode.LlamaDecodeCopy`` for this Llama);
- ``reprefill_batched``: G=8 together, whole context re-prefilled every turn (``reprefill=True``);
- ``kv_sequential``: one episode at a time, KV reuse;
- ``naive``: one episode at a time, whole context re-prefilled every turn;
- ``kv_batched_module``: as ``kv_batched`` but with the module-tree ``DecodeCopy`` (merged,
  transposed weights run through transformers' forward, ``lean_decode=False``): the lean
  layout's gain, side by side;
- ``kv_batched_native``: as ``kv_batched`` but forwarding the policy module itself instead of
  a decode copy: the copies' gain, side by side;
- ``kv_batched_strided``: as ``kv_batched`` with the lean copy's weights kept strided
  (``HFGenerator(packed_weights=False)``) instead of oneDNN-packed: the packed layout's gain,
  side by side (the same as ``kv_batched`` where torch has no oneDNN);
- ``kv_batched_matmul_attention``: as ``kv_batched`` with decode attention as two batched
  matmuls (``HFGenerator(fused_attention=False)``) instead of the C loops of
  ``closedloop.engine.attention_loops``: their gain, side by side (the same as ``kv_batched``
  where no C compiler built them).

Throughput is sampled action tokens per second of generation wall time. One-at-a-time modes
run ``--seq-episodes`` episodes (default 1; the per-episode cost does not depend on how many
run), batched modes one group of G. Modes alternate in rotated order for ``--repeats`` and the
ratios are medians of per-repeat ratios, all from this one process.

Matmul precision (``--precision``, default ``both``; ``closedloop.engine.precision``): every mode,
the naive loop included, runs at the given precision (``HFGenerator(precision=...)``:
``bfloat16`` computes every Linear as float32(bf16(x) @ bf16(W)^T), fp32 master weights, the
rest fp32). With ``both``, each repeat runs the whole mode rotation once in float32 and once in
bfloat16, in this one process; ratios (and their targets) are taken within one precision only.
The line "bfloat16 vs float32" per mode is for information.

    .venv/bin/python benchmarks/bench_generation.py [--repeats 1] [--threads 1] [--quick]
        [--tiny] [--skip reprefill_batched] [--precision float32|bfloat16|both]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine_label, median, rotate, set_threads

from closedloop.contracts import SamplerConfig
from closedloop.engine import PRECISIONS, HFGenerator
from closedloop.policy import ChatRenderer, build_tiny_model, load_model

SYSTEM = "You are a careful agent that repairs files. " * 6
TOOLS = [{"name": n, "description": f"{n} a file in the workspace",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}
         for n in ("read_file", "write_file", "list_dir")]
MODES = ("kv_batched", "reprefill_batched", "kv_sequential", "naive", "kv_batched_module",
         "kv_batched_native", "kv_batched_strided", "kv_batched_matmul_attention")
TARGETS = {"kv_batched/reprefill_batched": 2.0, "kv_batched/kv_sequential": 3.0,
           "kv_batched/naive": 5.0, "kv_sequential/naive": 2.0,
           "kv_batched/kv_batched_module": 1.0, "kv_batched/kv_batched_native": 1.0,
           "kv_batched/kv_batched_strided": 1.0, "kv_batched/kv_batched_matmul_attention": 1.0}


def run_episodes(gen: HFGenerator, prompt: list[int], n: int, turns: int, action: int,
                 obs_ids: list[int], seed: int) -> tuple[int, float]:
    """Run ``n`` episodes together in one batch; return (sampled ids, seconds)."""
    sids = gen.open_sessions([prompt] * n)
    rng = torch.Generator().manual_seed(seed)
    sampler = SamplerConfig()
    new = 0
    t0 = time.perf_counter()
    for turn in range(turns):
        gens = gen.generate_batch(sids, sampler, (), action, rng)
        new += sum(len(g.action_token_ids) for g in gens)
        if any(len(g.action_token_ids) != action for g in gens):
            raise RuntimeError("an action stopped early: the forced length did not hold")
        if turn + 1 < turns:
            for s in sids:
                gen.extend(s, obs_ids)
    dt = time.perf_counter() - t0
    for s in sids:
        gen.close(s)
    return new, dt


def measure(mode: str, model: object, tok: object, prompt: list[int], args: argparse.Namespace,
            obs_ids: list[int], seed: int, precision: str) -> tuple[float, float, int]:
    """One repeat of one mode at one matmul precision: (tokens/s, seconds, tokens)."""
    reprefill = mode in ("reprefill_batched", "naive")
    gen = HFGenerator(model, tok, reprefill=reprefill, stop_token_ids=(), stop_sequences=(),
                      weight_checksum="bench", decode_copy=mode != "kv_batched_native",
                      lean_decode=mode != "kv_batched_module", precision=precision,
                      packed_weights=mode != "kv_batched_strided",
                      fused_attention=mode != "kv_batched_matmul_attention")
    if "batched" in mode:
        new, dt = run_episodes(gen, prompt, args.group, args.turns, args.action, obs_ids, seed)
    else:
        new, dt = 0, 0.0
        for i in range(args.seq_episodes):
            n, d = run_episodes(gen, prompt, 1, args.turns, args.action, obs_ids, seed + i)
            new, dt = new + n, dt + d
    return new / dt, dt, new


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--group", type=int, default=8, help="G: sibling episodes in one batch")
    ap.add_argument("--action", type=int, default=24, help="action ids a turn (forced)")
    ap.add_argument("--obs", type=int, default=40, help="observation ids a turn")
    ap.add_argument("--seq-episodes", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (0: torch default; 1 avoids OpenMP oversubscription on a "
                    "shared 2-core host: 13 vs 1.1 tokens/s measured under load)")
    ap.add_argument("--skip", action="append", default=[], choices=MODES)
    ap.add_argument("--precision", choices=(*PRECISIONS, "both"), default="both",
                    help="matmul precision of every mode (both: each repeat runs both)")
    ap.add_argument("--tiny", action="store_true", help="random tiny model (smoke only)")
    ap.add_argument("--quick", action="store_true", help="~30 s smoke: small shapes, 1 repeat")
    ap.add_argument("--summary", help="append headline rows (JSON lines) to this file")
    args = ap.parse_args(argv)
    if args.quick:
        args.turns, args.group, args.action, args.obs, args.repeats = 3, 4, 8, 16, 1
    set_threads(args.threads)
    print(f"[generation] machine: {machine_label()}")
    t0 = time.perf_counter()
    loaded = load_model(None)
    model = build_tiny_model(loaded.tokenizer) if args.tiny else loaded.model
    precisions = list(PRECISIONS) if args.precision == "both" else [args.precision]
    print(f"[generation] model {'TINY random' if args.tiny else loaded.model_id}, fp32 weights, "
          f"load {time.perf_counter() - t0:.1f}s; matmul precision {', '.join(precisions)}")
    renderer = ChatRenderer(loaded.tokenizer, SYSTEM, TOOLS)
    prompt = renderer.render_prompt("Task: repair config.json so it parses, then run the check.")
    obs_ids = (renderer.render_observation("ok " * args.obs) * 2)[:args.obs]
    print(f"[generation] shape: prompt {len(prompt)} ids, {args.turns} turns x ({args.action} "
          f"action + {args.obs} obs ids), G={args.group}, one-at-a-time modes run "
          f"{args.seq_episodes} episode(s); final context "
          f"{len(prompt) + args.turns * args.action + (args.turns - 1) * args.obs} ids")
    modes = [m for m in MODES if m not in args.skip]
    rates: dict[str, dict[str, list[float]]] = {p: {m: [] for m in modes} for p in precisions}
    for rep in range(args.repeats):
        for precision in rotate(precisions, rep):
            for mode in rotate(modes, rep):
                rate, dt, new = measure(mode, model, loaded.tokenizer, prompt, args, obs_ids, rep,
                                        precision)
                rates[precision][mode].append(rate)
                print(f"[generation] rep {rep} {precision:8s} {mode:18s} {rate:7.1f} action "
                      f"tokens/s ({new} tokens in {dt:.1f}s)", flush=True)
    out: dict[str, float] = {}
    for precision in precisions:
        out.update(report(precision, rates[precision], args.summary))
    if len(precisions) == 2:
        for mode in modes:
            per = [b / f for b, f in zip(rates["bfloat16"][mode], rates["float32"][mode],
                                         strict=True)]
            print(f"[generation] {mode:18s} bfloat16 vs float32: {median(per):.2f}x "
                  f"(information; per-repeat {[round(r, 2) for r in per]})")
    return out


def report(precision: str, rates: dict[str, list[float]], summary: str | None) -> dict[str, float]:
    """Print and emit one precision's medians and its within-precision ratios vs TARGETS."""
    out: dict[str, float] = {}
    for mode, values in rates.items():
        out[f"{precision}.{mode}"] = rate = median(values)
        print(f"[generation] {precision:8s} {mode:18s} median {rate:7.1f} action tokens/s")
        emit(summary, "generation", f"{mode} tokens/s, {precision}", round(rate, 1), "tok/s")
    for pair, target in TARGETS.items():
        a, b = pair.split("/")
        if a in rates and b in rates:
            per = [x / y for x, y in zip(rates[a], rates[b], strict=True)]
            ratio = median(per)
            out[f"{precision}.{pair}"] = ratio
            print(f"[generation] {precision}: {a} vs {b}: {ratio:.2f}x (per-repeat "
                  f"{[round(r, 2) for r in per]}; target >= {target:g}x)")
            emit(summary, "generation", f"{a} vs {b}, {precision}", round(ratio, 2), "x",
                 f">= {target:g}x")
    return out


if __name__ == "__main__":
    main()
