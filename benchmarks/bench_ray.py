"""Benchmark (not a test): a Ray collection's wall time per group against the in-process one.

One process: the same groups of the same train tasks (the same seeds and sampling streams, so
the same episodes) rolled out by the in-process ``Collector`` with an ``HFGenerator``, and by
``RayCollection`` on a local Ray cluster (``--generator-workers`` generator workers with their
own policy copy, ``--env-workers`` environment workers). Repeats alternate the two; reported:
wall seconds per group of each (median) and the ratio Ray / in-process. Cluster start and actor
start-up (model load in each worker) are reported apart: a run pays them once.

    .venv/bin/python benchmarks/bench_ray.py [--groups 4] [--group 8] [--max-turns 4]
        [--action 64] [--reps 2] [--generator-workers 1] [--env-workers 2] [--threads 1]
        [--quick]

On a 2-core machine the workers share the cores with the driver: the ratio measures what the
process boundaries cost there, not what more machines would buy.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine_label, median, rotate, set_threads

from closedloop.contracts import SamplerConfig, sha256_hex
from closedloop.engine import HFGenerator
from closedloop.envs.terminal.package import terminal_package
from closedloop.envs.terminal.task_sets import list_tasks
from closedloop.policy import ChatRenderer, build_tiny_model, load_embedded_tokenizer, load_model
from closedloop.policy.weights import weights_checksum
from closedloop.rollout.collector import Collector, CollectorConfig
from closedloop.rollout.ray_workers import (
    HFPolicyBuilder,
    PolicySpec,
    RayCollection,
    RayWorkersConfig,
    ray_cluster,
    ray_unavailable_reason,
)
from closedloop.rollout.source import GeneratorSource
from closedloop.training.wiring import build_manifest


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--action", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--generator-workers", type=int, default=1)
    ap.add_argument("--env-workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="a tiny model, 2 groups of 4, 1 rep")
    ap.add_argument("--summary")
    args = ap.parse_args(argv)
    if args.quick:
        args.groups, args.group, args.max_turns, args.action, args.reps = 2, 4, 3, 16, 1
    reason = ray_unavailable_reason()
    if reason is not None:
        print(f"[ray] skipped: {reason}")
        return
    set_threads(args.threads)
    print(f"[ray] machine: {machine_label()}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.quick:
            tok = load_embedded_tokenizer()
            model = build_tiny_model(tok, seed=2, init_std=0.3)
            model.save_pretrained(Path(tmp) / "tiny")
            tok.save_pretrained(Path(tmp) / "tiny")
            folder = str(Path(tmp) / "tiny")
        else:
            loaded = load_model(None)
            model, tok = loaded.model, loaded.tokenizer
            folder = str(load_model(None).path)  # the safetensors cache copy
        run(args, model, tok, folder)


def run(args: argparse.Namespace, model: object, tok: object, folder: str) -> None:
    """Both collections, alternated; print and emit the figures."""
    package = terminal_package()
    renderer = ChatRenderer(tok, package.system_prompt, [dict(t) for t in package.tool_schemas])
    checksum = weights_checksum(model)  # type: ignore[arg-type]
    sampler = SamplerConfig(temperature=0.7)
    manifest = build_manifest(policy_version="v0000", weight_checksum=checksum,
                              tokenizer_revision=sha256_hex("bench"), renderer=renderer,
                              sampler=sampler, step_budget=args.max_turns,
                              max_action_tokens=args.action, model_id="bench")
    config = CollectorConfig(max_turns=args.max_turns, sampling_salt=7)
    local = Collector(GeneratorSource(HFGenerator(model, tok, seed=0, weight_checksum=checksum),
                                      renderer.action_text, sampler, args.action,
                                      manifest.generator_build),
                      renderer, package.make_env, None, package.family_split, manifest,
                      "bench-ray", None, config)
    workers = RayWorkersConfig(env_workers=args.env_workers, env_worker_cpus=0.25,
                               generator_workers=args.generator_workers,
                               generator_worker_cpus=1.0, num_cpus=os.cpu_count(),
                               object_store_mb=200)
    t0 = time.perf_counter()
    with ray_cluster(workers):
        t1 = time.perf_counter()
        spec = PolicySpec(HFPolicyBuilder(folder, seed=0), renderer, renderer.action_text,
                          package.family_split, "bench-ray", config, threads=args.threads)
        ray = RayCollection(spec, package.make_env, workers)
        ray.load({}, checksum)
        print(f"[ray] cluster start {t1 - t0:.1f} s, workers ready {time.perf_counter() - t1:.1f}"
              f" s ({args.generator_workers} generator, {args.env_workers} environment)")
        walls: dict[str, list[float]] = {"in-process": [], "ray": []}
        tasks = list_tasks(split="train")
        for rep in range(args.reps):
            leases = [local.make_lease(f"r{rep}g{i}", tasks[i % len(tasks)], 100 * rep + i,
                                       args.group) for i in range(args.groups)]
            for mode in rotate(list(walls), rep):
                t = time.perf_counter()
                groups = local.rollout(leases) if mode == "in-process" \
                    else ray.collect(manifest, leases)
                walls[mode].append((time.perf_counter() - t) / len(groups))
                print(f"[ray] rep {rep} {mode:10s}: {walls[mode][-1]:.2f} s per group")
        ray.shutdown()
    per = {mode: median(w) for mode, w in walls.items()}
    ratio = per["ray"] / per["in-process"]
    print(f"[ray] wall per group: in-process {per['in-process']:.2f} s, Ray {per['ray']:.2f} s;"
          f" Ray / in-process x{ratio:.2f} ({'tiny model' if args.quick else 'SmolLM2-135M'}, "
          f"{args.groups} groups of {args.group}, median of {args.reps})")
    print(f"[ray] machine: {machine_label('at the end')}")
    emit(args.summary, "ray", "Ray / in-process wall per group", round(ratio, 2), "x")


if __name__ == "__main__":
    main()
