"""Benchmark (not a test): the real ``rl_step`` against TRL's ``GRPOTrainer``, single turn.

The workload (both sides): the embedded SmolLM2 model (fp32 master weights, the safetensors
cache folder of ``load_model(None)``), the 8 prompts of ``single_turn_pkg.PROMPTS`` behind the
same system message (closedloop's rendered scaffold; TRL gets it as a system message and the
TRL script checks that its chat template gives the same prompt ids), G=4 completions each of
at most 32 tokens stopping at ``<|im_end|>``, LoRA r=8 alpha 16 on q/k/v/o, KL beta 0.02 to the
adapter-free base, lr 1e-4, temperature 1, group-normalized advantages, token-mean loss, and
the verifier-free reward ``len(reply) % 2``.

Ours is what a user runs: ``closedloop.training.rl_step.rl_step`` on a run opened in a
temporary directory (``_realstep.RealStep``) with every contract on — the group lease and
base snapshot, the generator worker under a published version, the clean-room verifier step
on the exported state, the trace, admission and the ledger, credit, the trainer's update,
the atomic checkpoint, the publication of the next version (stage, the worker loads it and
acknowledges its checksum) and the metrics record. The environment package is
``single_turn_pkg`` (a reply ends the episode; the verifier scores the exported state).

Differences, stated: TRL scores and back-propagates all 32 completions in one pass and, by
default, trains on truncated completions; closedloop censors a completion cut by the token
budget (``max_token_truncation``, never scored; ``credit.censor_rule: drop_censored`` keeps a
group's other members) and trains in micro-batches of 4 (the trainer's default); the benchmark
prints the episodes and action tokens each side trained on (``--trl-mask-truncated`` gives TRL
``mask_truncated_completions=True``). closedloop also stops an action at ``</tool_call>``
(rarely written in these replies). TRL keeps its default gradient checkpointing unless
``--trl-no-checkpointing``. Advantages: TRL's GRPO (scaled by the group's std) against
closedloop's ``grpo`` estimator.

Precision, the same on both sides of a ratio: ``float32`` (ours fp32; TRL
``GRPOConfig(bf16=False)``) and ``bfloat16`` (ours ``training.precision: bfloat16``, every
Linear in bf16 with fp32 masters; TRL ``GRPOConfig(bf16=True)``, its CPU autocast). bf16 is
measured only where the CPU multiplies it natively (``closedloop.engine.resolve_precision``:
``amx_bf16``/``avx512_bf16``); elsewhere it is reported as not measured, with the reason
(emulated bf16 runs ~100x slower and measures nothing a user would run).

Each precision gets a fresh run (its own model and adapter). The sides alternate — ours,
TRL, ours, TRL, ... (``--rounds`` TRL passes, each bracketed by ours) — and the first step of
each pass is a warm-up left out of the medians. Besides the ratio (target: ours >= 3x faster
in fp32, >= 5x in bf16) it prints where our step's time goes: generation, environment, update
and the contracts' bookkeeping, itemized (target: bookkeeping <= 5% of the step).

    .venv/bin/python benchmarks/bench_trl.py [--steps 3] [--rounds 1] [--threads 2]
        [--precision float32|bfloat16|both] [--trl-no-checkpointing] [--trl-mask-truncated]
        [--no-trl] [--quick] [--tiny] [--summary PATH]

``--tiny``: both sides on a random tiny Llama saved to a temporary folder (a check that the
benchmark runs, in seconds; its figures mean nothing). ``--quick``: ours only, embedded
model, 2 steps. TRL runs in ``.bench-venv`` (``make bench`` creates it;
TRL is never a dependency of closedloop).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import single_turn_pkg
from _common import emit, machine_label, median, set_threads
from _realstep import RealStep, items_line, share_line

from closedloop.config import (
    CreditSection,
    EnvironmentSection,
    EvaluationSection,
    RolloutSection,
    RunConfig,
    SFTSection,
    TrainingSection,
    UpdateSection,
)
from closedloop.engine import resolve_precision
from closedloop.policy import build_tiny_model, load_model
from closedloop.policy.registry import version_name
from closedloop.rollout.work_orders import GroupSpec, WorkOrder
from closedloop.training.wiring import make_renderer

ROOT = Path(__file__).resolve().parent.parent
BENCH_PY = ROOT / ".bench-venv" / "bin" / "python"
TARGETS = {"float32": 3.0, "bfloat16": 5.0}


def bench_config(model: str, precision: str, args: argparse.Namespace) -> RunConfig:
    """The run config of our side (module doc)."""
    return RunConfig(
        model=model,
        environment=EnvironmentSection(factory="single_turn_pkg:package",
                                       train_tasks=len(single_turn_pkg.PROMPTS),
                                       heldout_tasks=1, max_turns=1),
        rollout=RolloutSection(group_size=args.group, temperature=1.0,
                               max_action_tokens=args.completion),
        credit=CreditSection(estimator="grpo", reduction="token_mean",
                             censor_rule="drop_censored"),
        update=UpdateSection(kl_beta=0.02),
        evaluation=EvaluationSection(environment_family_disjoint=False, retain_suites=[]),
        training=TrainingSection(rl_steps=2 * args.steps * (args.rounds + 1) + 2,
                                 groups_per_step=len(single_turn_pkg.PROMPTS),
                                 learning_rate=1e-4, lora_rank=8, lora_alpha=16,
                                 lora_targets=["q_proj", "k_proj", "v_proj", "o_proj"],
                                 precision=precision),
        sft=SFTSection(enabled=False))


def order_of(step: int, group: int) -> WorkOrder:
    """Every prompt once per step, G completions each (TRL's batch: 8 prompts x G)."""
    return WorkOrder(step, version_name(step), tuple(
        GroupSpec(f"s{step:04d}-g{j}", f"prompt-{j}", 1000 * step + j, group)
        for j in range(len(single_turn_pkg.PROMPTS))))


def native_bf16() -> tuple[bool, str]:
    """Whether this host multiplies bf16 natively, and the policy's reason."""
    choice = resolve_precision("auto")
    return choice.precision == "bfloat16", choice.reason


def run_trl(model_dir: str, system: str, prompt_ids: list[list[int]],
            args: argparse.Namespace, bf16: bool) -> dict[str, Any] | str:
    """TRL's GRPO steps in .bench-venv; its result, or why it did not run."""
    if not BENCH_PY.is_file():
        return "skipped: .bench-venv is absent (make .bench-venv/.ready)"
    spec = {"system": system, "prompts": list(single_turn_pkg.PROMPTS),
            "prompt_ids": prompt_ids}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(spec, fh)
    cmd = [str(BENCH_PY), str(ROOT / "benchmarks" / "trl_grpo_step.py"), model_dir, fh.name,
           "--steps", str(args.steps), "--threads", str(args.threads),
           "--completion", str(args.completion), "--generations", str(args.group)]
    cmd += ["--bf16"] if bf16 else []
    cmd += ["--no-gradient-checkpointing"] if args.trl_no_checkpointing else []
    cmd += ["--mask-truncated"] if args.trl_mask_truncated else []
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
    finally:
        Path(fh.name).unlink(missing_ok=True)
    for line in proc.stdout.splitlines():
        if line.startswith("[trl]"):
            print(line, flush=True)
        if line.startswith("TRL_RESULT "):
            result = dict(json.loads(line[len("TRL_RESULT "):]))
            if bool(result.get("bf16")) != bf16:
                return f"failed: TRL ran with bf16={result.get('bf16')}, asked for {bf16}"
            return result
    return f"failed (rc {proc.returncode}): {proc.stderr.strip()[-1500:]}"


TINY_STOP_STD = 1.0
"""The tiny model's ``<|im_end|>`` embedding (tied to its output row; zero as the padding row
at init) is drawn with this std, 50x the other rows': its logit then stands out at some
positions and replies end after 1-10 tokens. A random model otherwise never stops, every
episode is censored and the real step stops as unscorable before the update this check is
for."""


def tiny_model_dir(folder: Path) -> str:
    """A random tiny Llama with the embedded tokenizer, able to end a reply (``TINY_STOP_STD``),
    saved as a local HF folder."""
    loaded = load_model(None)
    model = build_tiny_model(loaded.tokenizer)
    stop = loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")
    seeded = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.get_input_embeddings().weight[stop] = torch.randn(
            model.config.hidden_size, generator=seeded) * TINY_STOP_STD
    model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    return str(folder)


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3, help="steps per side per pass (>= 2)")
    ap.add_argument("--rounds", type=int, default=1, help="TRL passes (each between ours)")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--completion", type=int, default=32)
    ap.add_argument("--precision", choices=("float32", "bfloat16", "both"), default="both")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--trl-no-checkpointing", action="store_true")
    ap.add_argument("--trl-mask-truncated", action="store_true")
    ap.add_argument("--no-trl", action="store_true", help="ours only")
    ap.add_argument("--tiny", action="store_true", help="both sides on a random tiny model")
    ap.add_argument("--quick", action="store_true", help="ours only, 2 steps")
    ap.add_argument("--summary")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.no_trl = 2, True
    args.steps = max(2, args.steps)
    set_threads(args.threads)
    print(f"[trl] machine: {machine_label()}")
    native, why = native_bf16()
    wanted = ["float32", "bfloat16"] if args.precision == "both" else [args.precision]
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_model_dir(Path(tmp) / "tiny") if args.tiny else str(
            load_model(None).path)
        for precision in wanted:
            if precision == "bfloat16" and not native and not args.tiny:
                print(f"[trl] bfloat16: not measured on this host ({why}); a bf16 step here "
                      "would run emulated, ~100x slower, and measure nothing a user runs")
                emit(args.summary, "trl", "bfloat16", "not measured: no native bf16")
                continue
            cfg = bench_config(model_dir if args.tiny else "embedded", precision, args)
            out.update(bracket(cfg, model_dir, precision, Path(tmp) / f"run-{precision}", args))
    return out


def bracket(cfg: RunConfig, model_dir: str, precision: str, folder: Path,
            args: argparse.Namespace) -> dict[str, float]:
    """Ours and TRL alternated at one precision; print the ratio and our breakdown."""
    tag = f"[trl] {precision}:"
    ours = RealStep(cfg, folder)
    try:
        renderer = make_renderer(ours.run.policy.tokenizer, ours.run.ctx.package)
        system = renderer.template.system_content(renderer.system_prompt,
                                                  renderer.tool_schemas)
        prompt_ids = [renderer.render_prompt(p) for p in single_turn_pkg.PROMPTS]
        print(f"{tag} ours set-up {ours.setup_s:.1f}s (run directory, model, adapter, "
              f"v0000 published); prompts {min(map(len, prompt_ids))}-"
              f"{max(map(len, prompt_ids))} ids")
        parts: list[dict[str, Any]] = []
        trl_runs: list[dict[str, Any]] = []
        trl_note = "skipped (--no-trl/--quick)"
        for rnd in range(1 if args.no_trl else args.rounds + 1):
            parts += ours_pass(ours, args, tag, f"pass {rnd + 1}")
            if args.no_trl or rnd == args.rounds:
                continue
            trl = run_trl(model_dir, system, prompt_ids, args, bf16=precision == "bfloat16")
            if isinstance(trl, str):
                trl_note = trl
                print(f"{tag} TRL: {trl}")
                if rnd == 0:
                    break
            else:
                trl_runs.append(trl)
    finally:
        ours.close()
    return report(parts, trl_runs, trl_note, precision, args)


def ours_pass(ours: RealStep, args: argparse.Namespace, tag: str, label: str
              ) -> list[dict[str, Any]]:
    """``args.steps`` real steps; all but the first (a warm-up) returned."""
    kept = []
    for i in range(args.steps):
        p = ours.step(order_of(ours.next_step, args.group))
        print(f"{tag} ours ({label}) step {i + 1}: {p['wall']:.2f}s = {share_line(p)}; "
              f"{p['episodes']} episodes ({p['censored']} censored), trained on "
              f"{p['trained_episodes']} ({p['trained_tokens']} action tokens)", flush=True)
        if i:
            kept.append(p)
    return kept


def report(parts: list[dict[str, Any]], trl_runs: list[dict[str, Any]], trl_note: str,
           precision: str, args: argparse.Namespace) -> dict[str, float]:
    """Print and emit one precision's rows."""
    tag = f"[trl] {precision}:"
    ours_s = median([p["wall"] for p in parts])
    shares = {k: median([p[k] / p["wall"] for p in parts])
              for k in ("generation", "environment", "update", "bookkeeping")}
    mid = sorted(parts, key=lambda p: p["wall"])[len(parts) // 2]
    out = {f"{precision}.ours_s": ours_s, f"{precision}.bookkeeping_share": shares["bookkeeping"]}
    print(f"{tag} ours: median {ours_s:.2f}s per real rl_step ({len(parts)} steps after each "
          "pass's first)")
    print(f"{tag} where our step goes (median shares): " + ", ".join(
        f"{k} {100 * v:.1f}%" for k, v in shares.items()))
    overall = sum(p["bookkeeping"] for p in parts) / sum(p["wall"] for p in parts)
    seconds = sorted(p["bookkeeping"] for p in parts)
    print(f"{tag} contract bookkeeping {100 * shares['bookkeeping']:.1f}% of the step (median "
          f"share; target <= 5%), {100 * overall:.1f}% of all {len(parts)} steps' wall time "
          f"({seconds[0]:.3f}-{seconds[-1]:.3f}s a step; the share moves with the update, which "
          f"scales with the episodes trained); its items in the median step: {items_line(mid)}")
    lengths = [n for p in parts for n in p["completion_lengths"]]
    trained = [p["trained_episodes"] for p in parts]
    emit(args.summary, "trl", f"ours s/real rl_step, {precision}", round(ours_s, 2), "s")
    emit(args.summary, "trl", f"bookkeeping share of the step, {precision}",
         round(100 * shares["bookkeeping"], 1), "%", "<= 5%")
    emit(args.summary, "trl", f"bookkeeping share of all steps' wall time, {precision}",
         round(100 * overall, 1), "%", "<= 5%")
    if not trl_runs:
        print(f"{tag} TRL: {trl_note}")
        return out
    trl_steps = [s for r in trl_runs for s in (r["steps_s"][1:] or r["steps_s"])]
    trl_s = median(trl_steps)
    ratio = trl_s / ours_s
    out[f"{precision}.trl_s"], out[f"{precision}.ratio"] = trl_s, ratio
    t = trl_runs[-1]
    print(f"{tag} TRL {t['trl']} GRPOTrainer (bf16 {t['bf16']}, loss_type {t['loss_type']}, "
          f"gradient checkpointing {t['gradient_checkpointing']}, mask_truncated "
          f"{t['mask_truncated']}, threads {t['threads']}, prompt ids identical to ours "
          f"{t['prompt_ids_match']}; LM forwards {t['forwards']}): median {trl_s:.2f}s per step "
          f"({len(trl_steps)} steps after each pass's first); its split (median): "
          + ", ".join(f"{k} {v:.2f}s" for k, v in t["split_s"].items()))
    print(f"{tag} completions (max {args.completion}): ours mean length "
          f"{sum(lengths) / max(1, len(lengths)):.1f}, trained on {median(trained):.0f} of "
          f"{parts[0]['episodes']} per step (censored: cut by the budget); TRL mean length "
          f"{t['completion_mean_length']}, clipped ratio {t.get('clipped_ratio')}, trained on "
          f"all {parts[0]['episodes']}" + (" (truncated masked)" if t["mask_truncated"] else ""))
    target = TARGETS[precision]
    print(f"{tag} ours {ours_s:.2f}s vs TRL {trl_s:.2f}s per step: ours is {ratio:.2f}x faster "
          f"(target >= {target:.0f}x)")
    emit(args.summary, "trl", f"TRL s/GRPO step, {precision}", round(trl_s, 2), "s")
    emit(args.summary, "trl", f"TRL / real rl_step, {precision}", round(ratio, 2), "x",
         f">= {target:.0f}x")
    return out


if __name__ == "__main__":
    main()
