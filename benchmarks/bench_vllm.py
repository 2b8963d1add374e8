"""Benchmark (not a test): the vLLM generator against the embedded one on the same episodes.

One process, one model folder (SmolLM2's safetensors copy, or with ``--quick`` a tiny random
Llama with head_dim 32), the same groups of the same train tasks collected by the real
``Collector`` through two sources: ``HFGenerator`` in process (its KV cache per session), and
``VLLMGenerator`` over a vLLM CPU engine process (``.vllm-venv``; prefix caching, processed
log-probs). One untimed collection warms each up; repeats then alternate the two (A, B, A, B:
drift hits both alike), each collecting fresh episodes with fresh seeds. Reported per
generator: action tokens/s and episodes/s of the collection wall time (environment steps
included: what a run's collection pays), and the ratio vLLM / embedded of both; the engine's
start-up time is reported apart (paid once per run).

    .venv/bin/python benchmarks/bench_vllm.py [--groups 2] [--group 8] [--max-turns 4]
        [--action 64] [--reps 2] [--threads 1] [--quick]

Without the vLLM environment it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine_label, median, rotate, set_threads

from closedloop.contracts import SamplerConfig, sha256_hex
from closedloop.engine import (
    EngineConfig,
    HFGenerator,
    VLLMEngine,
    VLLMGenerator,
    vllm_unavailable_reason,
)
from closedloop.envs.terminal.package import terminal_package
from closedloop.envs.terminal.task_sets import list_tasks
from closedloop.policy import ChatRenderer, build_tiny_model, load_embedded_tokenizer, load_model
from closedloop.policy.weights import weights_checksum
from closedloop.rollout.source import GeneratorSource
from closedloop.training.wiring import CollectorParts, build_manifest, make_collector


def model_folder(quick: bool, scratch: Path) -> tuple[str, object, object]:
    """(folder, model, tokenizer): a tiny Llama saved to ``scratch`` or SmolLM2's cache copy."""
    if quick:
        tok = load_embedded_tokenizer()
        model = build_tiny_model(tok, seed=2, hidden=128, heads=4, init_std=0.3)
        model.save_pretrained(scratch / "tiny")
        tok.save_pretrained(scratch / "tiny")
        return str(scratch / "tiny"), model, tok
    loaded = load_model(None)  # writes the safetensors cache on first use
    return str(loaded.path if loaded.source != "gguf" else load_model(None).path), \
        loaded.model, loaded.tokenizer


def collect(generator: object, build: str, tok: object, checksum: str, args: argparse.Namespace,
            rep: int) -> tuple[float, int, int]:
    """One collection of ``args.groups`` groups; (wall seconds, action tokens, episodes)."""
    package = terminal_package()
    renderer = ChatRenderer(tok, package.system_prompt, [dict(t) for t in package.tool_schemas])
    sampler = SamplerConfig(temperature=0.7)
    manifest = build_manifest(policy_version="v0000", weight_checksum=checksum,
                              tokenizer_revision=sha256_hex("bench"), renderer=renderer,
                              sampler=sampler, step_budget=args.max_turns,
                              max_action_tokens=args.action, model_id="bench")
    source = GeneratorSource(generator, renderer.action_text, sampler, args.action, build)
    collector = make_collector(source, manifest, CollectorParts(
        renderer, package.verifier(), "bench-vllm", None, args.max_turns, package,
        sampling_salt=1000 + rep))
    tasks = list_tasks(split="train")
    leases = [collector.make_lease(f"r{rep}g{i}", tasks[i % len(tasks)], 100 * rep + i,
                                   args.group) for i in range(args.groups)]
    t0 = time.perf_counter()
    groups = collector.collect(leases)
    wall = time.perf_counter() - t0
    tokens = sum(len(t.action_token_ids) for g in groups for ep in g.episodes for t in ep.turns)
    return wall, tokens, sum(len(g.episodes) for g in groups)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--action", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="a tiny model, 1 group of 4, 1 rep")
    ap.add_argument("--summary")
    args = ap.parse_args(argv)
    if args.quick:
        args.groups, args.group, args.max_turns, args.action, args.reps = 1, 4, 3, 16, 1
    reason = vllm_unavailable_reason()
    if reason is not None:
        print(f"[vllm] skipped: {reason}")
        return
    set_threads(args.threads)
    print(f"[vllm] machine: {machine_label()}")
    with tempfile.TemporaryDirectory() as tmp:
        folder, model, tok = model_folder(args.quick, Path(tmp))
        checksum = weights_checksum(model)
        t0 = time.perf_counter()
        engine = VLLMEngine(EngineConfig(model=folder, threads=args.threads, max_loras=1),
                            log_path=Path(tmp) / "engine.log")
        print(f"[vllm] engine start-up {time.perf_counter() - t0:.1f} s "
              f"(vllm {engine.hello.get('vllm_version')}, {engine.hello.get('logprobs_mode')})")
        try:
            gens = {"embedded": HFGenerator(model, tok, seed=0, weight_checksum=checksum),
                    "vllm": VLLMGenerator(engine, tok, base_checksum=checksum, seed=0)}
            runs: dict[str, list[tuple[float, int, int]]] = {k: [] for k in gens}
            for name in gens:  # untimed: the engine's first requests, the HF caches
                collect(gens[name], name, tok, checksum, args, -1)
            for rep in range(args.reps):
                for name in rotate(list(gens), rep):
                    runs[name].append(collect(gens[name], name, tok, checksum, args, rep))
                    w, n, e = runs[name][-1]
                    print(f"[vllm] rep {rep} {name:8s}: {e} episodes, {n} action tokens in "
                          f"{w:.1f} s")
        finally:
            engine.close()
    rates = {name: (median([n / w for w, n, _ in r]), median([e / w for w, _, e in r]))
             for name, r in runs.items()}
    for name, (tps, eps) in rates.items():
        print(f"[vllm] {name:8s}: {tps:.1f} action tokens/s, {eps:.2f} episodes/s")
    tok_ratio = rates["vllm"][0] / rates["embedded"][0]
    ep_ratio = rates["vllm"][1] / rates["embedded"][1]
    print(f"[vllm] vLLM / embedded: tokens/s x{tok_ratio:.2f}, episodes/s x{ep_ratio:.2f} "
          f"({'tiny model' if args.quick else 'SmolLM2-135M'}, {args.groups} x {args.group} "
          f"episodes per collection, median of {args.reps})")
    print(f"[vllm] machine: {machine_label('at the end')}")
    emit(args.summary, "vllm", "vLLM / embedded action tokens/s", round(tok_ratio, 2), "x")
    emit(args.summary, "vllm", "vLLM / embedded episodes/s", round(ep_ratio, 2), "x")


if __name__ == "__main__":
    main()
