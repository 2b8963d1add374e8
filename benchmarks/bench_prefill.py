"""Benchmark (not a test): the generator's prefills of a real evaluation, with and without the
two savings of its prefill (``HFGenerator``'s ``packed_prefill`` and ``share_prompt_prefix``).

An evaluation of a run (its trace, e.g. ``runs/<smoke>/arms/frozen/traces/eval-start-train.jsonl``:
distinct prompts under one scaffold, observations of unequal length) is replayed through
``HFGenerator`` on the embedded SmolLM2: every episode's prompt is opened, then each turn k
extends the episodes still running at k with their recorded observation ids and samples one
id (so the timed work is the prefills, and one decode step a turn). Two modes, alternated in
one process for ``--repeats``:

- ``ours``: the generator as runs use it: a padded prefill's projections and MLP run on its
  real ids only, and the prompts' common leading ids (the system message) are prefilled once;
- ``padded``: both off (``packed_prefill=False, share_prompt_prefix=False``): every distinct
  prompt prefilled whole, every turn's observations padded to the longest.

Prints ids prefilled and seconds per mode and turn, and the median ratio padded / ours.

    .venv/bin/python benchmarks/bench_prefill.py --trace TRACE [--episodes 48] [--repeats 2]
        [--threads 2] [--summary PATH]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine_label, median, rotate, set_threads

from closedloop.contracts import Episode, SamplerConfig, load_episodes
from closedloop.engine import HFGenerator
from closedloop.policy import load_model

MODES = {"ours": {}, "padded": {"packed_prefill": False, "share_prompt_prefix": False}}


def replay(gen: HFGenerator, episodes: list[Episode], sampler: SamplerConfig
           ) -> tuple[float, list[float], int]:
    """Seconds in all, seconds per turn, and ids prefilled, for one replay (module doc)."""
    before = gen.stats.prefill_tokens
    start = time.perf_counter()
    sessions = gen.open_sessions([ep.turns[0].prompt_token_ids for ep in episodes])
    per_turn = []
    for k in range(max(len(ep.turns) for ep in episodes)):
        live = [(s, ep) for s, ep in zip(sessions, episodes, strict=True) if len(ep.turns) > k]
        if k:
            for s, ep in live:
                gen.extend(s, ep.turns[k].prompt_token_ids)
        t = time.perf_counter()
        gen.generate_batch([s for s, _ in live], sampler, max_new_tokens=1)
        per_turn.append(time.perf_counter() - t)
    for s in sessions:
        gen.close(s)
    return time.perf_counter() - start, per_turn, gen.stats.prefill_tokens - before


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True, help="an evaluation trace of a run (module doc)")
    ap.add_argument("--episodes", type=int, default=48, help="its first N episodes")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--summary", default=None)
    args = ap.parse_args(argv)
    set_threads(args.threads)
    print(f"[prefill] machine: {machine_label()}", flush=True)
    episodes = list(load_episodes(args.trace)[1])[: args.episodes]
    if not episodes:
        raise SystemExit(f"{args.trace}: no episodes")
    loaded = load_model()
    gens = {m: HFGenerator(loaded.model, loaded.tokenizer, **kw) for m, kw in MODES.items()}
    sampler = SamplerConfig(temperature=0.7)
    real = sum(len(t.prompt_token_ids) for ep in episodes for t in ep.turns)
    print(f"[prefill] {len(episodes)} episodes, {real} prompt and observation ids, "
          f"{max(len(ep.turns) for ep in episodes)} turns at most", flush=True)
    seconds: dict[str, list[float]] = {m: [] for m in MODES}
    ratios = []
    for rep in range(args.repeats):
        for mode in rotate(list(MODES), rep):
            wall, per_turn, ids = replay(gens[mode], episodes, sampler)
            seconds[mode].append(wall)
            turns = ", ".join(f"{x:.1f}" for x in per_turn)
            print(f"[prefill] repeat {rep} {mode}: {wall:.1f} s, {ids} ids prefilled; per turn "
                  f"{turns} s", flush=True)
        ratios.append(seconds["padded"][-1] / seconds["ours"][-1])
    ratio = median(ratios)
    print(f"[prefill] ours {median(seconds['ours']):.1f} s, padded "
          f"{median(seconds['padded']):.1f} s (medians): padded / ours {ratio:.2f}x "
          f"(per repeat {', '.join(f'{r:.2f}' for r in ratios)})", flush=True)
    print(f"[prefill] machine at end: {machine_label('at end')}", flush=True)
    emit(args.summary, "prefill", "padded / ours, an evaluation's prefills", ratio, "x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
