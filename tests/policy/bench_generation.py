"""Benchmark (not a test): batched multi-turn generation with vs without KV reuse.

Run: .venv/bin/python -m tests.policy.bench_generation [--turns 3] [--batch 8] [--threads 1]
     [--repeats 3] [--catcache]
On a shared 2-core host, ``--threads 1`` avoids OpenMP oversubscription (measured: a batch-8
decode step took 1.29 s with 2 threads vs 0.29 s with 1 while other jobs ran).
Episode shape of design.md §6: ~200-token prompt, +40 observation ids and +24 action ids a turn.
Prints load times, tokens/s for both modes, their ratio and whether greedy outputs agree; all
ratios come from one run (the host drifts 10-25% between runs).
"""

import argparse
import statistics
import time

import torch

from closedloop.contracts import SamplerConfig
from closedloop.policy import ChatRenderer, HFGenerator, build_tiny_model, load_model

SYSTEM = "You are a careful agent that repairs files. " * 6
TOOLS = [{"name": n, "description": f"{n} a file in the workspace",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}
         for n in ("read_file", "write_file", "list_dir")]


def episode(gen, renderer, batch, turns, sampler, obs_ids):
    prompts = [renderer.render_prompt(f"Task {i}: repair config.json so it parses.")
               for i in range(batch)]
    sids = gen.open_sessions(prompts)
    rng = torch.Generator().manual_seed(0)
    outs, n_new = [], 0
    t0 = time.perf_counter()
    for _ in range(turns):
        gens = gen.generate_batch(sids, sampler, (), 24, rng)
        outs.append([g.action_token_ids for g in gens])
        n_new += sum(len(g.action_token_ids) for g in gens)
        for s in sids:
            gen.extend(s, obs_ids)
    dt = time.perf_counter() - t0
    ctx = len(gen.context(sids[0]))
    for s in sids:
        gen.close(s)
    return n_new / dt, dt, outs, ctx


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--catcache", action="store_true", help="also time plain DynamicCache")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    t0 = time.perf_counter()
    loaded = load_model()
    print(f"load_model: {time.perf_counter() - t0:.1f}s (source={loaded.source}, "
          f"inner {loaded.load_seconds:.1f}s)")
    model = build_tiny_model(loaded.tokenizer) if args.tiny else loaded.model
    renderer = ChatRenderer(loaded.tokenizer, SYSTEM, TOOLS)
    obs_ids = renderer.render_observation("ok " * 30)[:40]
    greedy = SamplerConfig(greedy=True)
    modes = [("kv_reuse", False, True), ("reprefill", True, True)]
    if args.catcache:
        modes.append(("kv_reuse_catcache", False, False))
    rates: dict[str, list[float]] = {m[0]: [] for m in modes}
    outputs: dict[str, list] = {}
    for rep in range(args.repeats):  # rotate the order: drift on a shared host hits all modes
        for name, reprefill, growing in modes[rep % len(modes):] + modes[:rep % len(modes)]:
            gen = HFGenerator(model, loaded.tokenizer, reprefill=reprefill,
                              growing_cache=growing, weight_checksum=loaded.weight_checksum)
            rate, dt, outs, ctx = episode(gen, renderer, args.batch, args.turns, greedy, obs_ids)
            rates[name].append(rate)
            outputs[name] = outs
            print(f"rep {rep} {name:17s}: {rate:6.1f} new tokens/s ({dt:.1f}s, final context "
                  f"{ctx}, prefilled {gen.stats.prefill_tokens} ids in "
                  f"{gen.stats.prefill_s:.1f}s, decoded {gen.stats.decode_tokens} ids in "
                  f"{gen.stats.decode_s:.1f}s)")
    med = {k: statistics.median(v) for k, v in rates.items()}
    for other in med:
        if other != "kv_reuse":
            ratios = [a / b for a, b in zip(rates["kv_reuse"], rates[other], strict=True)]
            print(f"kv_reuse vs {other}: median {med['kv_reuse']:.1f} vs {med[other]:.1f} "
                  f"tokens/s, per-repeat ratios {[round(r, 2) for r in ratios]}")
    same = all(o == outputs["kv_reuse"] for o in outputs.values())
    print(f"greedy outputs identical across modes: {same}")

if __name__ == "__main__":
    main()
