"""Benchmark (not a test): the multi-turn tool workload — the real ``rl_step`` against TRL's
``GRPOTrainer`` with its ``environment_factory`` tool loop, on the terminal-repair tasks.

The same on both sides: the policy (the embedded SmolLM2 warm-started by closedloop's own SFT
on noisy-expert demonstrations, merged into the base and saved as a local HF folder for TRL),
the tasks (the first ``--tasks`` train tasks of the smoke's task set), the tools and the system
message (the terminal package's scaffold, rendered once; TRL's prompt ids are checked equal),
the step budget (``--max-turns`` model turns), G, temperature 0.7, LoRA r=8 alpha 16 on the
smoke's seven projections, KL beta 0.02 to the warm-started base, the smoke's learning rate,
one optimizer step per batch of ``tasks x G`` episodes, and the reward: the terminal package's
clean-room verifier on the exported state.

Ours: ``closedloop.training.rl_step.rl_step`` on a run opened in a temporary directory
(``_realstep.RealStep``) with the smoke's config (``closedloop.config.smoke_config``) at these
sizes: KV-cached multi-turn decoding (an observation is appended to the cache, never
re-prefilled), per-turn action limit ``rollout.max_action_tokens`` (the smoke's 128), censoring
of truncated episodes, every contract on. TRL: ``benchmarks/trl_env_step.py`` in
``.bench-venv`` — a thin wrapper (``TerminalTools``) that imports closedloop's terminal
environment and verifier there and exposes each tool as a method; each TRL turn stops at
``</tool_call>`` within the run's per-turn limit (given to TRL's ``generate``), and
``max_completion_length`` (``--trl-budget``) bounds the whole multi-turn completion, tool
results included. TRL re-prefills the whole context every turn, has no censoring (an episode
that ends without ``finish`` scores 0), cannot let the environment end an episode (after
``finish`` the model is prompted again), and trains in micro-batches of ``--trl-micro``.

Per side and step it prints: wall time, model turns, action and observation tokens, and the
share in generation, environment, update and (ours) contract bookkeeping, (TRL) reward and
scoring. Target: ours >= 6x faster per step. The sides alternate (ours, TRL, ours); the first
step of each pass is a warm-up left out of the medians. ``--trl-steps 1`` times TRL's first step
only, its warm-up included (which can only add to TRL's time; compare it with our first step
too): at 8 turns and a 2048-token budget, one TRL step on 2 CPU cores can take an hour.
Precision: float32, or bfloat16 where the CPU multiplies it natively (``--precision``; never
emulated bf16).

    .venv/bin/python benchmarks/bench_trl_multiturn.py [--steps 2] [--tasks 8] [--group 4]
        [--max-turns 8] [--sft-demos 48] [--sft-epochs 3] [--sft-adapter DIR] [--save-sft DIR]
        [--threads 2]
        [--precision float32|bfloat16] [--trl-steps N] [--trl-budget 2048] [--trl-micro 8]
        [--no-trl] [--quick] [--summary PATH]

``--sft-adapter DIR``: reuse a run's warm start (a folder holding ``adapter.pt`` and
``result.json``, e.g. ``<smoke run>/sft``; it must match the smoke's LoRA shape) instead of
training one; ``--save-sft DIR`` keeps the one trained here for that. ``--quick`` (with
``--sft-adapter``): 2 tasks x G=2, one step per side (a check that both sides run; its figures
mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, give_back_free_memory, machine_label, median, set_threads
from _realstep import RealStep, items_line, share_line

from closedloop.config import RunConfig, smoke_config
from closedloop.engine import resolve_precision
from closedloop.policy.registry import version_name
from closedloop.rollout.work_orders import GroupSpec, WorkOrder
from closedloop.training.run import Run

ROOT = Path(__file__).resolve().parent.parent
BENCH_PY = ROOT / ".bench-venv" / "bin" / "python"
TARGET = 6.0


def bench_config(args: argparse.Namespace, precision: str) -> RunConfig:
    """The smoke's config at the benchmark's sizes (module doc)."""
    base = smoke_config()
    r = dataclasses.replace
    return base.with_overrides(
        environment=r(base.environment, max_turns=args.max_turns),
        rollout=r(base.rollout, group_size=args.group),
        evaluation=r(base.evaluation, retain_suites=[]),
        training=r(base.training, rl_steps=4 * args.steps + 2, groups_per_step=args.tasks,
                   precision=precision),
        sft=r(base.sft, demonstrations=args.sft_demos, epochs=args.sft_epochs))


def order_of(run: Run, step: int, args: argparse.Namespace) -> WorkOrder:
    """The same ``--tasks`` train tasks every step, G episodes each."""
    tasks = run.ctx.tasks.train[: args.tasks]
    return WorkOrder(step, version_name(step), tuple(
        GroupSpec(f"s{step:04d}-g{j}", t, 1000 * step + j, args.group)
        for j, t in enumerate(tasks)))


def save_policy(run: Run, folder: Path) -> None:
    """Hook after the warm start: save the merged policy (π_ref) for TRL."""
    run.policy.model.save_pretrained(folder)
    run.policy.tokenizer.save_pretrained(folder)


def spec_for(run: Run, args: argparse.Namespace) -> dict[str, Any]:
    """What TRL's side needs: system message, tasks with first observations and prompt ids."""
    renderer = run.policy.renderer
    package = run.ctx.package
    tasks = []
    for j, task_id in enumerate(run.ctx.tasks.train[: args.tasks]):
        observation = package.make_env().reset(task_id, j)
        tasks.append({"task_id": task_id, "seed": j, "observation": observation,
                      "prompt_ids": renderer.render_prompt(observation)})
    cfg = run.cfg
    return {"system": renderer.template.system_content(renderer.system_prompt,
                                                       renderer.tool_schemas),
            "tasks": tasks, "max_turns": cfg.environment.max_turns,
            "max_action_tokens": cfg.rollout.max_action_tokens,
            "temperature": cfg.rollout.temperature,
            "learning_rate": cfg.training.learning_rate,
            "lora_targets": list(cfg.training.lora_targets)}


def run_trl(model_dir: Path, spec: dict[str, Any], args: argparse.Namespace, bf16: bool,
            steps: int) -> dict[str, Any] | str:
    """TRL's environment_factory steps in .bench-venv; its result, or why it did not run."""
    if not BENCH_PY.is_file():
        return "skipped: .bench-venv is absent (make .bench-venv/.ready)"
    give_back_free_memory("multiturn")  # TRL's step needs ~13 GB beside this process
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(spec, fh)
    cmd = [str(BENCH_PY), str(ROOT / "benchmarks" / "trl_env_step.py"), str(model_dir),
           fh.name, "--steps", str(steps), "--threads", str(args.threads),
           "--generations", str(args.group), "--budget", str(args.trl_budget),
           "--micro", str(args.trl_micro)] + (["--bf16"] if bf16 else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result: dict[str, Any] | None = None
    try:
        # Streamed, so each step's time shows as it ends (a pass can take an hour on a CPU).
        # stderr (progress bars) goes to a file: an unread pipe would fill and stall TRL.
        with tempfile.TemporaryFile("w+") as err, subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("[trl-env]"):
                    print(line.rstrip(), flush=True)
                if line.startswith("TRL_RESULT "):
                    result = dict(json.loads(line[len("TRL_RESULT "):]))
            proc.wait()
            err.seek(0)
            stderr = err.read()
    finally:
        Path(fh.name).unlink(missing_ok=True)
    if result is not None:
        return result
    return f"failed (rc {proc.returncode}): {stderr.strip()[-2000:]}"


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2, help="steps per side per pass (>= 2)")
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-turns", type=int, default=8, help="the step budget (model turns)")
    ap.add_argument("--sft-demos", type=int, default=48)
    ap.add_argument("--sft-epochs", type=int, default=3)
    ap.add_argument("--sft-adapter", help="reuse a run's warm start (a folder with adapter.pt "
                    "and result.json)")
    ap.add_argument("--save-sft", help="copy the warm start (adapter.pt, result.json) to this "
                    "folder once trained, for a later --sft-adapter")
    ap.add_argument("--precision", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--trl-steps", type=int, help="TRL's steps (default --steps); 1 times TRL's "
                    "first step, its warm-up included (a TRL step can take an hour on 2 cores)")
    ap.add_argument("--trl-budget", type=int, default=2048)
    ap.add_argument("--trl-micro", type=int, default=8)
    ap.add_argument("--no-trl", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--summary")
    args = ap.parse_args(argv)
    if args.quick:
        if not args.sft_adapter:
            ap.error("--quick needs --sft-adapter DIR: a warm start small enough for a size check "
                     "leaves every episode censored, and the run stops as unscorable")
        args.steps, args.tasks, args.group = 1, 2, 2
    set_threads(args.threads)
    print(f"[multiturn] machine: {machine_label()}")
    if args.precision == "bfloat16" and resolve_precision("auto").precision != "bfloat16":
        print(f"[multiturn] bfloat16: not measured on this host "
              f"({resolve_precision('auto').reason})")
        emit(args.summary, "multiturn", "bfloat16", "not measured: no native bf16")
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        folder, policy_dir = Path(tmp) / "run", Path(tmp) / "policy"
        if args.sft_adapter:
            (folder / "sft").mkdir(parents=True)
            for name in ("adapter.pt", "result.json"):
                shutil.copy(Path(args.sft_adapter) / name, folder / "sft" / name)
        ours = RealStep(bench_config(args, args.precision), folder, warm=True,
                        after_open=lambda run: save_policy(run, policy_dir))
        try:
            if args.save_sft:
                shutil.copytree(folder / "sft", args.save_sft, dirs_exist_ok=True)
            spec = spec_for(ours.run, args)
            print(f"[multiturn] set-up {ours.setup_s:.1f}s (run directory, warm start, policy "
                  f"saved for TRL); {args.tasks} tasks x G={args.group}, <= {args.max_turns} "
                  f"turns, {ours.run.cfg.rollout.max_action_tokens} action tokens a turn")
            parts = ours_pass(ours, args, "pass 1")
            trl = "skipped (--no-trl)" if args.no_trl else run_trl(
                policy_dir, spec, args, args.precision == "bfloat16",
                args.trl_steps or args.steps)
            if not isinstance(trl, str) or args.quick:
                parts += ours_pass(ours, args, "pass 2")
        finally:
            ours.close()
    return report(parts, trl, args)


def ours_pass(ours: RealStep, args: argparse.Namespace, label: str) -> list[dict[str, Any]]:
    """``args.steps`` real steps; all but the first returned (the only one under --quick)."""
    kept = []
    for i in range(args.steps):
        p = ours.step(order_of(ours.run, ours.next_step, args))
        print(f"[multiturn] ours ({label}) step {i + 1}: {p['wall']:.2f}s = {share_line(p)}; "
              f"{p['episodes']} episodes, {p['turns']} model turns, {p['action_tokens']} action "
              f"+ {p['observation_tokens']} observation tokens, success {p['success']}, "
              f"{p['censored']} censored, trained on {p['trained_episodes']}", flush=True)
        if i or args.steps == 1:
            kept.append(p)
    return kept


def report(parts: list[dict[str, Any]], trl: dict[str, Any] | str,
           args: argparse.Namespace) -> dict[str, float]:
    """Print and emit the comparison."""
    ours_s = median([p["wall"] for p in parts])
    shares = {k: median([p[k] / p["wall"] for p in parts])
              for k in ("generation", "environment", "update", "bookkeeping")}
    mid = sorted(parts, key=lambda p: p["wall"])[len(parts) // 2]
    print(f"[multiturn] ours: median {ours_s:.2f}s per real rl_step; "
          f"{median([p['turns'] for p in parts]):.0f} model turns, "
          f"{median([p['action_tokens'] for p in parts]):.0f} action + "
          f"{median([p['observation_tokens'] for p in parts]):.0f} observation tokens per step; "
          + ", ".join(f"{k} {100 * v:.1f}%" for k, v in shares.items()))
    print(f"[multiturn] ours: contract bookkeeping items (median step): {items_line(mid)}")
    emit(args.summary, "multiturn", "ours s/real rl_step (multi-turn)", round(ours_s, 2), "s")
    emit(args.summary, "multiturn", "ours bookkeeping share (multi-turn)",
         round(100 * shares["bookkeeping"], 1), "%", "<= 5%")
    out = {"ours_s": ours_s}
    if isinstance(trl, str):
        print(f"[multiturn] TRL: {trl}")
        return out
    steps = trl["steps_s"][1:] or trl["steps_s"]
    rolls = trl["rollouts"][1:] or trl["rollouts"]
    if len(trl["steps_s"]) == 1:
        print("[multiturn] TRL ran one step: its figure is a first step, warm-up included "
              "(ours leaves its first step out)")
    trl_s = median(steps)
    split = trl["split_s"]
    print(f"[multiturn] TRL {trl['trl']} environment_factory (bf16 {trl['bf16']}, budget "
          f"{trl['budget']} tokens per episode, micro-batch {trl['micro']}, prompt ids "
          f"identical to ours {trl['prompt_ids_match']}): median {trl_s:.2f}s per step; "
          f"{median([r['model_turns'] for r in rolls]):.0f} model turns, "
          f"{median([r['action_tokens'] for r in rolls]):.0f} action + "
          f"{median([r['observation_tokens'] for r in rolls]):.0f} observation tokens, "
          f"{median([r['finished'] for r in rolls]):.0f} episodes ended by finish/abstain, "
          f"rewards {trl['rewards']}; " + ", ".join(
              f"{k} {v:.2f}s ({100 * v / trl_s:.0f}%)" for k, v in split.items()))
    ratio = trl_s / ours_s
    print(f"[multiturn] ours {ours_s:.2f}s vs TRL {trl_s:.2f}s per step: ours is {ratio:.2f}x "
          f"faster (target >= {TARGET:.0f}x)")
    emit(args.summary, "multiturn", "TRL s/step (environment_factory)", round(trl_s, 2), "s")
    emit(args.summary, "multiturn", "TRL / real rl_step (multi-turn)", round(ratio, 2), "x",
         f">= {TARGET:.0f}x")
    out.update(trl_s=trl_s, ratio=ratio)
    return out


if __name__ == "__main__":
    main()
