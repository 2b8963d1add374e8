"""Benchmark (not a test): the share of rollout wall time spent on contract bookkeeping (issue 3).

Runs one real collection: ``Collector`` (via ``closedloop.training.wiring.make_collector``) over
fresh
``TerminalRepairEnv`` instances, a ``GeneratorSource`` on ``HFGenerator`` (KV reuse, G siblings
in one batch), the ``Verifier`` and a ``TraceWriter`` to a temporary file. It then sums the
per-episode ``timings`` the collector records (decode_s, env_s, render_s, bookkeeping_s,
reset_s, verify_s) and compares them with the wall time of ``collect``. Bookkeeping here is
``bookkeeping_s`` (TurnRecord build + state hash after + trace write) + ``verify_s``; the wall
time no timing covers (state hash before each turn, trajectory records, group bookkeeping) is
printed as ``unattributed`` and counted as bookkeeping in the upper bound. Target: <= 5%.

    .venv/bin/python benchmarks/bench_rollout.py [--group 8] [--max-turns 6] [--action 96]
        [--threads 1] [--quick] [--tiny]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine_label, set_threads

from closedloop.contracts import SamplerConfig, TraceWriter
from closedloop.engine import HFGenerator
from closedloop.envs.terminal.package import AGENT_TOOLS, SYSTEM_PROMPT
from closedloop.envs.terminal.task_sets import build_task_sets
from closedloop.envs.terminal.verifier import Verifier
from closedloop.policy import ChatRenderer, build_tiny_model, load_model
from closedloop.rollout.source import GeneratorSource
from closedloop.training.wiring import CollectorParts, build_manifest, make_collector

KEYS = ("decode_s", "env_s", "render_s", "bookkeeping_s", "reset_s", "verify_s")


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--max-turns", type=int, default=6)
    ap.add_argument("--action", type=int, default=96, help="max_action_tokens (config default)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tiny", action="store_true", help="random tiny model (smoke only)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--summary")
    args = ap.parse_args(argv)
    if args.quick:
        args.group, args.max_turns, args.action = 4, 3, 16
    set_threads(args.threads)
    print(f"[rollout] machine: {machine_label()}")
    loaded = load_model(None)
    model = build_tiny_model(loaded.tokenizer) if args.tiny else loaded.model
    gen = HFGenerator(model, loaded.tokenizer, seed=0)
    renderer = ChatRenderer(loaded.tokenizer, SYSTEM_PROMPT, list(AGENT_TOOLS))
    sampler = SamplerConfig()
    manifest = build_manifest(
        policy_version="bench", weight_checksum=gen.weight_checksum,
        tokenizer_revision=loaded.tokenizer_revision, renderer=renderer, sampler=sampler,
        step_budget=args.max_turns, max_action_tokens=args.action, model_id=loaded.model_id)
    source = GeneratorSource(gen, renderer.action_text, sampler, args.action,
                             manifest.generator_build)
    tasks = [b.spec.task_id for b in build_task_sets(max(4, args.groups), 2, seed=0).train]
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.jsonl"
        with TraceWriter(trace) as writer:
            parts = CollectorParts(renderer, Verifier(), "bench", writer, args.max_turns)
            collector = make_collector(source, manifest, parts)
            leases = [collector.make_lease(f"g{j}", tasks[j % len(tasks)], 1 + j, args.group)
                      for j in range(args.groups)]
            t0 = time.perf_counter()
            groups = collector.collect(leases)
            wall = time.perf_counter() - t0
        trace_bytes = trace.stat().st_size
    episodes = [ep for g in groups for ep in g.episodes]
    totals = {k: sum(ep.trajectory.timings.get(k, 0.0) for ep in episodes) for k in KEYS}
    turns = sum(len(ep.turns) for ep in episodes)
    tokens = sum(ep.trajectory.num_action_tokens for ep in episodes)
    unattributed = max(0.0, wall - sum(totals.values()))
    term = sorted({str(ep.trajectory.termination.value) for ep in episodes})
    print(f"[rollout] {len(episodes)} episodes ({args.groups} group(s) of G={args.group}), "
          f"{turns} turns, {tokens} action tokens, terminations {term}, trace {trace_bytes} "
          f"bytes; collect wall {wall:.2f}s")
    for k in KEYS:
        print(f"[rollout] {k:14s} {totals[k]:8.3f}s  {100 * totals[k] / wall:6.2f}% of wall")
    print(f"[rollout] {'unattributed':14s} {unattributed:8.3f}s  "
          f"{100 * unattributed / wall:6.2f}% of wall")
    book = totals["bookkeeping_s"] + totals["verify_s"]
    share = book / wall
    upper = (book + unattributed + totals["reset_s"]) / wall
    print(f"[rollout] contract bookkeeping share: {100 * share:.2f}% (bookkeeping_s + verify_s); "
          f"upper bound {100 * upper:.2f}% (+ unattributed + reset_s, which includes the base "
          f"snapshot); target <= 5%")
    emit(args.summary, "rollout", "bookkeeping share of collect wall", round(100 * share, 2),
         "%", "<= 5%")
    emit(args.summary, "rollout", "bookkeeping share, upper bound", round(100 * upper, 2), "%",
         "<= 5%")
    emit(args.summary, "rollout", "collect wall", round(wall, 1), "s")
    return {"share": share, "upper": upper, "wall": wall}


if __name__ == "__main__":
    main()
