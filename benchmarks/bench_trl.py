"""Benchmark (not a test): one GRPO step of ours vs one of TRL's ``GRPOTrainer`` (issue 4).

Same embedded model (fp32 weights, the safetensors cache folder of ``load_model(None)``), same 8
prompts (chat-templated user turns), G=4 generations each, 32 completion tokens, single turn,
LoRA r=8 alpha 16 on q/k/v/o, KL beta 0.02 to the adapter-free base, lr 1e-4, temperature 1, and
the same verifier-free reward (completion length in characters mod 2).

Ours, built from our parts: ``HFGenerator.generate_batch`` over 32 sessions (max_new_tokens=32,
stopping at the tokenizer's EOS id as TRL's generation does; the 8 distinct prompts prefilled
once; sampling from the generator's decode copy, the lean Llama layout of ``llama_decode``),
reward, ``grpo`` group credit, a right-padded ``TrainingBatch`` of prompt + completion
(completions masked in, behaviour log-probs from the generator), ``Trainer.step``
(reinforce_with_kl, token_mean reducer, each distinct prompt forwarded once per micro-batch for
π_θ and for π_ref), ``refresh_weights`` (publish: re-sync the decode copy). Micro-batch
(``--micro``) 32 by default: TRL scores and back-propagates the whole batch of 32 completions in
one pass (``per_device_train_batch_size=32``), so 32 is the like-for-like setting.

Precision (``--precision``, default ``both``), the same on both sides of every ratio:

- ``float32``: ours fp32 throughout; TRL ``GRPOConfig(bf16=False)``.
- ``bfloat16``: ours with the bf16 matmul precision (``closedloop.engine.precision``: every
  Linear computes float32(bf16(x) @ bf16(W)^T), fp32 master weights, the rest fp32) in the
  generator's decode copy and in the trainer; TRL with its standard mixed precision,
  ``trl_grpo_step.py --bf16`` (``GRPOConfig(bf16=True)``: fp32 model, CPU bf16 autocast through
  accelerate; its report counts which of its forwards actually ran under autocast: its
  log-prob forwards and backward do, its generation's decode steps do not, since
  ``PeftModel.generate`` bypasses accelerate's wrapped forward).

Each precision gets its own freshly loaded model and LoRA adapter (``attach_lora`` wraps the base
in place, so the two never share weights). Per precision the order is ours, TRL, ours again
(brackets drift); the first step of each side is a warm-up and is left out of the medians. The
line "ours bfloat16 vs TRL float32" is printed for information only: it mixes precisions and
comes from two brackets; the targets apply within one precision. TRL:
``benchmarks/trl_grpo_step.py`` in ``.bench-venv`` (TRL is installed only there), timed per
optimizer step by a callback.

    .venv/bin/python benchmarks/bench_trl.py [--steps 2] [--threads 1]
        [--precision float32|bfloat16|both] [--micro 32] [--trl-no-checkpointing] [--quick]
        [--tiny]
Set-up of .bench-venv (once): ``make .bench-venv/.ready`` (or python3 -m venv .bench-venv &&
    .bench-venv/bin/pip install torch==2.13.0 && .bench-venv/bin/pip install trl peft)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine_label, median, set_threads

from closedloop.contracts import SamplerConfig
from closedloop.contracts.batch import TrainingBatch
from closedloop.engine import PRECISIONS, HFGenerator
from closedloop.learn.credit import grpo
from closedloop.learn.trainer import Trainer, TrainerConfig
from closedloop.policy import attach_lora, build_tiny_model, load_model

ROOT = Path(__file__).resolve().parent.parent
BENCH_PY = ROOT / ".bench-venv" / "bin" / "python"
PROMPTS = [
    "Write a one-line Python function that reverses a string.",
    "Name three prime numbers greater than 50.",
    "Explain in one sentence what a hash function does.",
    "Give a shell command that counts lines in a file.",
    "What is the capital of Australia? Answer briefly.",
    "Suggest a name for a cat that likes boxes.",
    "Convert 3 kilometres to metres and show the arithmetic.",
    "List two differences between TCP and UDP.",
]


def reward_parity(text: str) -> float:
    """The shared verifier-free reward (identical in trl_grpo_step.py)."""
    return float(len(text) % 2)


class OurGRPOStep:
    """One single-turn GRPO step with closedloop's generator, credit and trainer."""

    def __init__(self, model: Any, tok: Any, prompts: list[str], group: int, completion: int,
                 micro: int, precision: str = "float32") -> None:
        self.tok, self.group, self.completion = tok, group, completion
        self.prompt_ids = []
        for p in prompts:
            text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True)
            self.prompt_ids.append(tok(text, add_special_tokens=False)["input_ids"])
        # TRL stops a completion at its EOS ids (the tokenizer's EOS and the generation
        # config's: both <|im_end|> for SmolLM2), so ours stops there too.
        self.gen = HFGenerator(model, tok, stop_token_ids=(int(tok.eos_token_id),),
                               stop_sequences=(), seed=0, weight_checksum="bench",
                               precision=precision)
        self.completion_lengths: list[int] = []
        self.trainer = Trainer(model, TrainerConfig(reducer="token_mean", kl_beta=0.02,
                                                    micro_batch_size=micro, precision=precision),
                               reference=model.disable_adapter)
        self.pad = int(tok.pad_token_id or 0)

    def step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        prompts = [p for p in self.prompt_ids for _ in range(self.group)]
        sids = self.gen.open_sessions(prompts)
        gens = self.gen.generate_batch(sids, SamplerConfig(), (), self.completion)
        for s in sids:
            self.gen.close(s)
        t1 = time.perf_counter()
        self.completion_lengths += [len(g.action_token_ids) for g in gens]
        rewards = torch.tensor([reward_parity(self.tok.decode(g.action_token_ids))
                                for g in gens])
        adv = torch.cat([grpo(rewards[i:i + self.group])
                         for i in range(0, len(rewards), self.group)])
        batch = self._batch(prompts, gens)
        self.trainer.step(batch, adv)
        t2 = time.perf_counter()
        self.gen.refresh_weights("bench")
        t3 = time.perf_counter()
        return {"total": t3 - t0, "generate": t1 - t0, "update": t2 - t1, "publish": t3 - t2}

    def _batch(self, prompts: list[list[int]], gens: list[Any]) -> TrainingBatch:
        rows = [p + list(g.action_token_ids) for p, g in zip(prompts, gens, strict=True)]
        b, t = len(rows), max(len(r) for r in rows)
        ids = torch.full((b, t), self.pad, dtype=torch.long)
        attn = torch.zeros(b, t, dtype=torch.long)
        mask = torch.zeros(b, t)
        beh = torch.zeros(b, t)
        turns = torch.full((b, t), -1, dtype=torch.long)
        for i, (p, g) in enumerate(zip(prompts, gens, strict=True)):
            n, a = len(rows[i]), len(g.action_token_ids)
            ids[i, :n] = torch.tensor(rows[i])
            attn[i, :n] = 1
            mask[i, len(p):n] = 1.0
            beh[i, len(p):n] = torch.tensor(g.behavior_logprobs)
            turns[i, len(p):n] = 0
            assert a == n - len(p)
        return TrainingBatch(ids, attn, mask, beh, beh.clone(), turns,
                             tuple(f"e{i}" for i in range(b)),
                             tuple(f"g{i // self.group}" for i in range(b)))


def run_trl(model_dir: str, args: argparse.Namespace, bf16: bool) -> dict[str, Any] | str:
    """Run TRL's GRPO steps in .bench-venv; return its result or why it did not run."""
    if not BENCH_PY.is_file():
        return ("skipped: .bench-venv is absent (python3 -m venv .bench-venv && "
                ".bench-venv/bin/pip install torch==2.13.0 && .bench-venv/bin/pip install trl "
                "peft)")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(PROMPTS, fh)
    cmd = [str(BENCH_PY), str(ROOT / "benchmarks" / "trl_grpo_step.py"), model_dir, fh.name,
           "--steps", str(args.steps), "--threads", str(args.threads),
           "--completion", str(args.completion), "--generations", str(args.group)]
    if bf16:
        cmd.append("--bf16")
    if args.trl_no_checkpointing:
        cmd.append("--no-gradient-checkpointing")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
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


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2, help="steps per side per pass (>= 2)")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--completion", type=int, default=32)
    ap.add_argument("--micro", type=int, default=32,
                    help="our micro-batch (32: the whole batch in one pass, like TRL's)")
    ap.add_argument("--precision", choices=(*PRECISIONS, "both"), default="both",
                    help="matmul precision of both sides (TRL: --bf16 for bfloat16)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--trl-no-checkpointing", action="store_true",
                    help="run TRL without its default gradient checkpointing (a stricter peer)")
    ap.add_argument("--no-trl", action="store_true", help="ours only")
    ap.add_argument("--tiny", action="store_true", help="ours only, random tiny model")
    ap.add_argument("--quick", action="store_true", help="ours only, 2 steps, 8 tokens")
    ap.add_argument("--summary")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.completion, args.no_trl = 2, 8, True
    if args.tiny:
        args.no_trl = True
    args.steps = max(2, args.steps)
    precisions = list(PRECISIONS) if args.precision == "both" else [args.precision]
    set_threads(args.threads)
    print(f"[trl] machine: {machine_label()}")
    loaded = load_model(None)
    print(f"[trl] shape: {len(PROMPTS)} prompts x {args.group} generations x {args.completion} "
          f"tokens, single turn, our micro-batch {args.micro}; model "
          f"{'TINY random' if args.tiny else loaded.path}; precisions {', '.join(precisions)}")
    out: dict[str, float] = {}
    for k, precision in enumerate(precisions):
        # A fresh base per precision: attach_lora wraps its base in place (peft), so a second
        # adapter on the same base would nest inside the first.
        if args.tiny:
            base = build_tiny_model(loaded.tokenizer)
        else:
            base = loaded.model if k == 0 else load_model(None).model
        ours = OurGRPOStep(attach_lora(base, r=8, alpha=16), loaded.tokenizer, PROMPTS,
                           args.group, args.completion, args.micro, precision=precision)
        out.update(bracket(ours, precision, str(loaded.path), args))
        del ours, base
    if "float32.trl_s" in out and "bfloat16.ours_s" in out:
        cross = out["float32.trl_s"] / out["bfloat16.ours_s"]
        out["mixed.ratio"] = cross
        print(f"[trl] for information only (mixed precisions, two brackets; not the target "
              f"comparison): ours bfloat16 {out['bfloat16.ours_s']:.2f}s vs TRL float32 "
              f"{out['float32.trl_s']:.2f}s: ours is {cross:.2f}x faster")
        emit(args.summary, "trl", "TRL fp32 / ours bf16 (mixed, info)", round(cross, 2), "x",
             "info only")
    return out


def bracket(ours: OurGRPOStep, precision: str, model_dir: str,
            args: argparse.Namespace) -> dict[str, float]:
    """Ours, TRL at the same precision, ours again; print and emit this precision's rows."""
    tag = f"[trl] {precision}:"

    def ours_pass(label: str) -> list[float]:
        times = []
        for i in range(args.steps):
            parts = ours.step()
            times.append(parts["total"])
            print(f"{tag} ours ({label}) step {i + 1}: {parts['total']:.2f}s (generate "
                  f"{parts['generate']:.2f}s, update {parts['update']:.2f}s, publish "
                  f"{parts['publish']:.3f}s)", flush=True)
        return times[1:]

    ours_times = ours_pass("before TRL")
    trl: dict[str, Any] | str = "skipped (--no-trl/--quick/--tiny)"
    if not args.no_trl:
        trl = run_trl(model_dir, args, bf16=precision == "bfloat16")
        ours_times += ours_pass("after TRL")
    out = {f"{precision}.ours_s": median(ours_times)}
    ours_s = out[f"{precision}.ours_s"]
    print(f"{tag} ours: median {ours_s:.2f}s per GRPO step (steps after the first)")
    emit(args.summary, "trl", f"ours s/GRPO step, {precision}", round(ours_s, 2), "s")
    if isinstance(trl, str):
        print(f"{tag} TRL: {trl}")
        emit(args.summary, "trl", f"TRL GRPOTrainer, {precision}", trl[:80])
        return out
    trl_s = median(trl["steps_s"][1:] or trl["steps_s"])
    ratio = trl_s / ours_s
    out[f"{precision}.trl_s"], out[f"{precision}.ratio"] = trl_s, ratio
    print(f"{tag} TRL {trl['trl']} GRPOTrainer (bf16 {trl['bf16']}, loss_type "
          f"{trl['loss_type']}, gradient checkpointing {trl.get('gradient_checkpointing')}, "
          f"threads {trl['threads']}; LM forwards {trl.get('forwards')}): median {trl_s:.2f}s "
          f"per step (steps after the first; set-up {trl['setup_s']:.1f}s)")
    mean_len = trl.get("completion_mean_length")
    ours_len = sum(ours.completion_lengths) / max(1, len(ours.completion_lengths))
    print(f"{tag} mean completion length (max {args.completion}, stop at EOS): ours "
          f"{ours_len:.1f}, TRL {mean_len if mean_len is None else round(mean_len, 1)}")
    print(f"{tag} ours {ours_s:.2f}s vs TRL {trl_s:.2f}s per GRPO step: ours is {ratio:.2f}x "
          f"faster (target >= 3x)")
    emit(args.summary, "trl", f"TRL s/GRPO step, {precision}", round(trl_s, 2), "s")
    emit(args.summary, "trl", f"TRL / ours (speed-up), {precision}", round(ratio, 2), "x",
         ">= 3x")
    return out


if __name__ == "__main__":
    main()
