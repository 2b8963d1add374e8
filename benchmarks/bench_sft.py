"""Benchmark (not a test): one supervised warm-start step's forward+backward, packed vs padded.

What ``supervised_warm_start`` runs per optimizer step: ``closedloop.learn.sft.sft_backward``
over a batch of ``--episodes`` demonstration episodes (cfg ``sft.batch_size``, 8), at the matmul
precision the run's precision policy resolves on this host (``--precision``, default ``auto``;
``closedloop.engine.host_precision``), as the warm start runs it. Two modes, alternated in
rotated order on the same batch and the same trainable LoRA parameters:

- ``packed``: ``sft_backward`` as it is since commit dd8b1ad: micro-batches of ``--micro`` (8)
  rows, each one decoder call with the prompt head its rows share (the scaffold's system
  message) forwarded once (``engine.common_prefix_lengths`` + ``shared_prefix_logprobs``);
- ``padded``: the path before it, kept here as the baseline: rows scored with
  ``engine.sequence_logprobs`` in right-padded micro-batches of ``--old-micro`` (2), the same
  loss (token-mean NLL of the action tokens over the whole batch).

Neither mode steps the optimizer (gradients are zeroed before each run), so every repeat scores
the same weights. Before timing, one untimed run of each mode checks that both give the same
loss (relative tolerance 1e-2 in bf16, 1e-4 in fp32) and the same action-token
count, and that both produced gradients; a broken comparison stops before any ratio is printed.

The demonstrations are real: the noisy expert (cfg ``sft.noise_rate``) through the collector on
the built-in terminal package (``terminal-repair-v1``), rendered with the embedded tokenizer,
as ``RunWarmStart.collect_demonstrations`` builds them (on the package's train tasks at task
seed 0, exact hint level; the run draws its demonstration tasks from task seed 1). The model is
the embedded SmolLM2-135M with a LoRA adapter (r=8, alpha=16 on q, k, v, o, gate, up, down);
``--quick`` uses the tiny random model (``build_tiny_model``) with the same adapter instead,
a smoke of the code path whose figures say nothing about the real model.

Tokens/s counts every real (non-pad) id of the batch. The headline is ``padded`` seconds per
step over ``packed`` seconds per step (median of the per-repeat ratios).

    .venv/bin/python benchmarks/bench_sft.py [--episodes 8] [--micro 8] [--old-micro 2]
        [--repeats 3] [--max-turns 8] [--precision auto] [--threads 1] [--quick]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine_label, median, rotate, set_threads

from closedloop.config import SFTSection, TrainingSection
from closedloop.contracts import Episode, SamplerConfig, content_hash, sha256_hex
from closedloop.contracts.package import ScriptedPolicyLike, TaskSetRequest
from closedloop.engine import matmul_precision, resolve_precision, sequence_logprobs
from closedloop.envs.discovery import resolve_package
from closedloop.learn.sft import sft_backward
from closedloop.policy import attach_lora, build_tiny_model, load_model, load_tokenizer
from closedloop.rollout.source import ScriptedSource
from closedloop.rollout.tensors import build_training_batch, shift_targets
from closedloop.training.wiring import CollectorParts, build_manifest, make_collector, make_renderer

ENV_ID = "terminal-repair-v1"
BF16_RTOL, FP32_RTOL = 1e-2, 1e-4


def padded_backward(model: torch.nn.Module, episodes: Sequence[Episode], pad_id: int,
                    micro_batch_size: int) -> tuple[float, int]:
    """The SFT loss as computed before commit dd8b1ad (the baseline): each micro-batch of
    right-padded rows scored whole by ``sequence_logprobs``; L = -(1/N) Σ m log πθ, N over all
    of ``episodes``. Returns (L, N)."""
    n_total = int(shift_targets(build_training_batch(episodes, pad_id=pad_id)).mask_B_T.sum())
    if n_total == 0:
        return 0.0, 0
    total = 0.0
    for start in range(0, len(episodes), micro_batch_size):
        batch = build_training_batch(episodes[start : start + micro_batch_size], pad_id=pad_id)
        mask = shift_targets(batch).mask_B_T
        logprobs = sequence_logprobs(model, batch.token_ids_B_T, batch.attention_mask_B_T,
                                     target_mask_B_T=mask)
        loss = -(logprobs * mask).sum() / n_total
        loss.backward()
        total += float(loss.detach())
    return total, n_total


def collect_demonstrations(n: int, max_turns: int, tokenizer: Any, rate: float,
                           seed: int = 0) -> list[Episode]:
    """``n`` noisy-expert episodes through the real collector, seeded like the warm start's."""
    package = resolve_package(ENV_ID)
    sets = package.task_sets(TaskSetRequest(
        train_tasks=8, heldout_tasks=2, seed=0,
        options={"train_levels": ["exact"], "heldout_levels": ["exact"]}))
    tasks = list(sets.train)
    renderer = make_renderer(tokenizer, package)

    def make_policy(task_id: str, key: str) -> ScriptedPolicyLike:
        return package.scripted_policy(
            "noisy", task_id, int(content_hash([seed, 0, key])[7:15], 16), rate)

    source = ScriptedSource(make_policy, renderer.encode, build="scripted-noisy")
    manifest = build_manifest(
        policy_version="scripted-noisy-expert",
        weight_checksum=sha256_hex(f"scripted-noisy-expert/{rate}"),
        tokenizer_revision=sha256_hex("bench-sft"), renderer=renderer, sampler=SamplerConfig(),
        step_budget=max_turns, max_action_tokens=128, model_id="scripted")
    parts = CollectorParts(renderer, package.verifier(), "bench-sft", None, max_turns, package,
                           sampling_salt=seed)  # no trace file: the episodes stay in memory
    collector = make_collector(source, manifest, parts)
    leases = [collector.make_lease(f"sft-demos-{i:04d}", tasks[i % len(tasks)], 1000 + i, 1)
              for i in range(n)]
    groups = collector.collect(leases)
    return [ep for g in groups for ep in g.episodes]


def lora_model(quick: bool, tokenizer: Any) -> Any:
    """The embedded model (gguf quantizer removed, as ``training.run.load_policy`` does) or,
    with ``quick``, the tiny random one; either with the run's LoRA adapter, in train mode."""
    train = TrainingSection()
    if quick:
        base = build_tiny_model(tokenizer)
    else:
        base = load_model(None).model
        if getattr(base, "hf_quantizer", None) is not None:
            base.hf_quantizer.remove_quantization_config(base)
    model = attach_lora(base, r=train.lora_rank, alpha=train.lora_alpha, seed=train.seed,
                        target_modules=tuple(train.lora_targets))
    model.train()
    return model


def grads(model: torch.nn.Module) -> torch.Tensor:
    """The trainable parameters' gradients, flattened (zeros where none)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten()
                      for p in model.parameters() if p.requires_grad])


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=SFTSection().batch_size,
                    help="demonstration episodes in the batch (one optimizer step)")
    ap.add_argument("--micro", type=int, default=8, help="packed micro-batch rows (sft now)")
    ap.add_argument("--old-micro", type=int, default=2, help="padded micro-batch rows (before)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-turns", type=int, default=8)
    ap.add_argument("--precision", choices=["auto", "float32", "bfloat16"], default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="tiny random model (smoke only)")
    ap.add_argument("--summary")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats = 3
    set_threads(args.threads)
    print(f"[sft] machine: {machine_label()}")
    precision = resolve_precision(args.precision).precision
    bf16 = precision == "bfloat16"
    t0 = time.perf_counter()
    tokenizer = load_tokenizer()
    pad_id = int(tokenizer.pad_token_id or 0)
    demos = collect_demonstrations(args.episodes, args.max_turns, tokenizer,
                                   SFTSection().noise_rate)
    t_demo = time.perf_counter() - t0
    model = lora_model(args.quick, tokenizer)
    batch = build_training_batch(demos, pad_id=pad_id)
    n_tok = int(batch.attention_mask_B_T.sum())
    n_act = int(shift_targets(batch).mask_B_T.sum())
    lengths = batch.attention_mask_B_T.sum(1).tolist()
    solved = sum(1 for ep in demos if (ep.trajectory.task_success or 0) >= 1)
    print(f"[sft] batch: {len(demos)} noisy-expert episodes ({solved} solved; collected in "
          f"{t_demo:.1f}s), lengths {min(lengths)}..{max(lengths)} ids, {n_tok} tokens "
          f"({n_act} action tokens); {'tiny random model' if args.quick else 'embedded model'}"
          f" + LoRA r=8 on q,k,v,o,gate,up,down; {precision} matmuls")

    def run(fn: Callable[..., tuple[float, int]], micro: int) -> tuple[float, int]:
        model.zero_grad(set_to_none=True)
        with matmul_precision(model, precision):
            return fn(model, demos, pad_id, micro)

    modes: dict[str, Callable[[], tuple[float, int]]] = {
        "packed": lambda: run(sft_backward, args.micro),
        "padded": lambda: run(padded_backward, args.old_micro)}
    # untimed warm-up of each mode, which is also the equality check
    checks = {}
    for name, fn in modes.items():
        loss, n = fn()
        checks[name] = (loss, n, grads(model))
    (l_new, n_new, g_new), (l_old, n_old, g_old) = checks["packed"], checks["padded"]
    rtol = BF16_RTOL if bf16 else FP32_RTOL
    rel = abs(l_new - l_old) / max(abs(l_old), 1e-12)
    g_rel = float((g_new - g_old).norm() / g_old.norm().clamp(min=1e-30))
    print(f"[sft] check: loss packed {l_new:.6f} vs padded {l_old:.6f} (relative difference "
          f"{rel:.2e}, tolerance {rtol:.0e}); {n_new} vs {n_old} action tokens; gradient "
          f"relative difference {g_rel:.2e} (printed, not asserted)")
    assert n_new == n_old == n_act, f"action-token counts differ: {n_new}, {n_old}, {n_act}"
    assert math.isfinite(l_new) and math.isfinite(l_old) and l_old > 0, "loss not finite"
    assert rel <= rtol, f"packed and padded losses differ by {rel:.2e} > {rtol:.0e}"
    assert float(g_new.norm()) > 0 and float(g_old.norm()) > 0, "a mode produced no gradient"
    assert bool(torch.isfinite(g_new).all() and torch.isfinite(g_old).all()), "grad not finite"

    secs: dict[str, list[float]] = {m: [] for m in modes}
    for rep in range(args.repeats):
        for name in rotate(list(modes), rep):
            t1 = time.perf_counter()
            modes[name]()
            dt = time.perf_counter() - t1
            secs[name].append(dt)
            print(f"[sft] rep {rep} {name:7s} {dt:7.3f}s  {n_tok / dt:8.1f} tokens/s", flush=True)
    model.zero_grad(set_to_none=True)
    out: dict[str, float] = {}
    label = "tiny model" if args.quick else "embedded"
    for name in modes:
        s = median(secs[name])
        out[f"{name}_s"] = s
        print(f"[sft] {name:7s} median {s:7.3f} s/step, {len(demos) / s:6.2f} episodes/s, "
              f"{n_tok / s:8.1f} tokens/s, {n_act / s:7.1f} action tokens/s")
        emit(args.summary, "sft", f"{name} step ({label}, {len(demos)} demos)", round(s, 3), "s")
        emit(args.summary, "sft", f"{name} tokens/s ({label})", round(n_tok / s, 1), "tok/s")
    ratio = median([o / n for o, n in zip(secs["padded"], secs["packed"], strict=True)])
    out["speedup"] = ratio
    print(f"[sft] speed-up of packed (micro {args.micro}) over padded (micro {args.old_micro}):"
          f" {ratio:.2f}x (padded s / packed s per step, median of {args.repeats} repeats)"
          + (" -- tiny random model: a smoke of the code path, not a measurement"
             if args.quick else ""))
    emit(args.summary, "sft", f"speed-up packed vs padded ({label})", round(ratio, 2), "x")
    print(f"[sft] machine: {machine_label('at the end')}")
    return out


if __name__ == "__main__":
    main()
