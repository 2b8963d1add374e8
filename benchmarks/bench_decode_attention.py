"""Benchmark (not a test): decode attention as two C loops against the two batched matmuls.

Two measurements, each alternating the two forms in one process:

- ``attention``: one decode step's attention at the multi-turn benchmark's shapes (32 rows,
  SmolLM2's 9 query / 3 key-value heads of 64, each of 30 layers its own cache buffer, so
  nothing stays cache-resident), at several cached lengths: ms per layer and the bytes of K/V
  read per second; ``closedloop.engine.decode_attention`` against
  ``matmul_decode_attention``, the form the decode copy falls back to;
- ``decode``: what the generator runs, ``HFGenerator`` on the embedded SmolLM2 (float32, packed
  weights) with ``fused_attention`` on and off: 32 sessions of one ``--context``-id prompt, then
  ``--steps`` sampled ids each; seconds per sampled id of a row (the shared prompt's prefill
  included).

Prints medians of ``--repeats`` and the ratio matmul / loops per measurement.

    .venv/bin/python benchmarks/bench_decode_attention.py [--threads 2] [--repeats 5]
        [--context 620] [--steps 16] [--no-model] [--summary PATH]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine_label, median, rotate, set_threads

MODES = ("loops", "matmul")
ROWS, HEADS, KV_HEADS, DIM, LAYERS = 32, 9, 3, 64, 30


def bench_attention(lengths: list[int], repeats: int, summary: str | None) -> None:
    import torch

    from closedloop.engine import decode_attention, matmul_decode_attention

    forms = {"loops": decode_attention, "matmul": matmul_decode_attention}
    for length in lengths:
        gen = torch.Generator().manual_seed(length)
        caches = [(torch.randn(ROWS, KV_HEADS, length + 64, DIM, generator=gen)[:, :, :length],
                   torch.randn(ROWS, KV_HEADS, length + 64, DIM, generator=gen)[:, :, :length])
                  for _ in range(LAYERS)]
        q = torch.randn(ROWS, KV_HEADS, HEADS // KV_HEADS, DIM, generator=gen)
        allowed = torch.ones(ROWS, 1, 1, length, dtype=torch.bool)
        allowed[::2, ..., : length // 10] = False  # half the rows left-padded
        times: dict[str, list[float]] = {m: [] for m in MODES}
        with torch.no_grad():
            for rep in range(repeats + 1):
                for mode in rotate(MODES, rep):
                    start = time.perf_counter()
                    for keys, values in caches:
                        forms[mode](q, keys, values, allowed, DIM ** -0.5)
                    if rep:
                        times[mode].append((time.perf_counter() - start) / LAYERS)
        kv_bytes = 2 * ROWS * KV_HEADS * length * DIM * 4
        row = {m: median(times[m]) for m in MODES}
        print(f"[attention] {ROWS} rows x {length} cached: loops {row['loops'] * 1e3:.2f} ms a "
              f"layer ({kv_bytes / row['loops'] / 1e9:.1f} GB/s of K/V), matmul "
              f"{row['matmul'] * 1e3:.2f} ms ({kv_bytes / row['matmul'] / 1e9:.1f} GB/s): "
              f"matmul / loops {row['matmul'] / row['loops']:.2f}x", flush=True)
        emit(summary, "decode_attention", f"attention matmul/loops at L={length}",
             round(row["matmul"] / row["loops"], 3), "x")


def bench_decode(context: int, steps: int, repeats: int, summary: str | None) -> None:
    """The generator as runs use it: ``ROWS`` sessions of one ``context``-id prompt, then
    ``steps`` sampled ids each, timed together (the prompt's prefill is in the first call)."""
    import torch

    from closedloop.contracts import SamplerConfig
    from closedloop.engine import HFGenerator
    from closedloop.policy import load_model

    loaded = load_model(None)
    gens = {m: HFGenerator(loaded.model, loaded.tokenizer, stop_token_ids=(), stop_sequences=(),
                           weight_checksum="bench", fused_attention=m == "loops")
            for m in MODES}
    prompt = torch.randint(100, 40000, (context,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    sampler = SamplerConfig(temperature=1.0)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for rep in range(repeats + 1):
        for mode in rotate(MODES, rep):
            gen = gens[mode]
            sids = gen.open_sessions([prompt] * ROWS)
            start = time.perf_counter()
            gen.generate_batch(sids, sampler, max_new_tokens=steps,
                               generator=torch.Generator().manual_seed(rep))
            took = time.perf_counter() - start
            for sid in sids:
                gen.close(sid)
            if rep:
                times[mode].append(took / steps)
    row = {m: median(times[m]) for m in MODES}
    print(f"[decode] SmolLM2 generator, {ROWS} sessions of a {context}-id prompt, {steps} ids "
          f"each (prefill included): loops {row['loops'] * 1e3:.1f} ms an id, matmul "
          f"{row['matmul'] * 1e3:.1f} ms: matmul / loops {row['matmul'] / row['loops']:.2f}x",
          flush=True)
    emit(summary, "decode_attention", f"generation matmul/loops at {context} ids",
         round(row["matmul"] / row["loops"], 3), "x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lengths", default="400,620,1000,1600")
    ap.add_argument("--context", type=int, default=620)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--no-model", action="store_true", help="the attention shapes only")
    ap.add_argument("--summary")
    args = ap.parse_args()
    set_threads(args.threads)
    from closedloop.engine import native_unavailable_reason

    print(f"[bench] {machine_label()}")
    if native_unavailable_reason():
        print(f"[bench] the C loops are not built here: {native_unavailable_reason()}")
        return
    bench_attention([int(x) for x in args.lengths.split(",")], args.repeats, args.summary)
    if not args.no_model:
        bench_decode(args.context, args.steps, args.repeats, args.summary)


if __name__ == "__main__":
    main()
