"""Benchmark (not a test): one GRPO step of ours vs one of TRL's ``GRPOTrainer`` (issue 4).

Same embedded model (fp32, the safetensors cache folder of ``load_model(None)``), same 8 prompts
(chat-templated user turns), G=4 generations each, 32 completion tokens, single turn, LoRA r=8
alpha 16 on q/k/v/o, KL beta 0.02 to the adapter-free base, lr 1e-4, temperature 1, and the same
verifier-free reward (completion length in characters mod 2).

Ours, built from our parts: ``HFGenerator.generate_batch`` over 32 sessions (max_new_tokens=32,
no stop; the 8 distinct prompts prefilled once; sampling from the generator's decode copy),
reward, ``grpo`` group credit, a right-padded ``TrainingBatch`` of prompt + completion
(completions masked in, behaviour log-probs from the generator), ``Trainer.step``
(reinforce_with_kl, token_mean reducer, micro-batches of 8, each distinct prompt forwarded once
per micro-batch for π_θ and for π_ref), ``refresh_weights`` (publish: re-sync the decode copy).
All fp32 on both sides. TRL: ``benchmarks/trl_grpo_step.py`` in ``.bench-venv`` (TRL is
installed only there), timed per optimizer step by a callback. Order: ours, TRL, ours again
(brackets drift); the first step of each side is a warm-up and is left out of the medians.

    .venv/bin/python benchmarks/bench_trl.py [--steps 2] [--threads 1] [--quick] [--tiny]
Set-up of .bench-venv (once): python3 -m venv .bench-venv &&
    .bench-venv/bin/pip install torch==2.13.0 && .bench-venv/bin/pip install trl peft
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
from closedloop.learn.credit import grpo
from closedloop.learn.trainer import Trainer, TrainerConfig
from closedloop.policy import HFGenerator, attach_lora, build_tiny_model, load_model
from closedloop.rollout.tensors import TrainingBatch

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
        self.gen = HFGenerator(model, tok, stop_token_ids=(), stop_sequences=(), seed=0,
                               weight_checksum="bench", precision=precision)
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


def run_trl(model_dir: str, args: argparse.Namespace) -> dict[str, Any] | str:
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
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("[trl]"):
            print(line, flush=True)
        if line.startswith("TRL_RESULT "):
            return dict(json.loads(line[len("TRL_RESULT "):]))
    return f"failed (rc {proc.returncode}): {proc.stderr.strip()[-1500:]}"


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2, help="steps per side per pass (>= 2)")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--completion", type=int, default=32)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
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
    set_threads(args.threads)
    print(f"[trl] machine: {machine_label()}")
    loaded = load_model(None)
    base = build_tiny_model(loaded.tokenizer) if args.tiny else loaded.model
    ours = OurGRPOStep(attach_lora(base, r=8, alpha=16), loaded.tokenizer, PROMPTS, args.group,
                       args.completion, args.micro)
    print(f"[trl] shape: {len(PROMPTS)} prompts x {args.group} generations x {args.completion} "
          f"tokens, single turn; model folder {loaded.path}")

    def ours_pass(label: str) -> list[float]:
        times = []
        for i in range(args.steps):
            parts = ours.step()
            times.append(parts["total"])
            print(f"[trl] ours ({label}) step {i + 1}: {parts['total']:.2f}s (generate "
                  f"{parts['generate']:.2f}s, update {parts['update']:.2f}s, publish "
                  f"{parts['publish']:.3f}s)", flush=True)
        return times[1:]

    ours_times = ours_pass("before TRL")
    trl: dict[str, Any] | str = "skipped (--no-trl/--quick/--tiny)"
    if not args.no_trl:
        trl = run_trl(str(loaded.path), args)
        ours_times += ours_pass("after TRL")
    out = {"ours_s": median(ours_times)}
    print(f"[trl] ours: median {out['ours_s']:.2f}s per GRPO step (steps after the first)")
    emit(args.summary, "trl", "ours s/GRPO step", round(out["ours_s"], 2), "s")
    if isinstance(trl, str):
        print(f"[trl] TRL: {trl}")
        emit(args.summary, "trl", "TRL GRPOTrainer", trl[:80])
        return out
    trl_steps = trl["steps_s"][1:] or trl["steps_s"]
    out["trl_s"] = median(trl_steps)
    out["ratio"] = out["trl_s"] / out["ours_s"]
    print(f"[trl] TRL {trl['trl']} GRPOTrainer (loss_type {trl['loss_type']}, threads "
          f"{trl['threads']}): median {out['trl_s']:.2f}s per step (steps after the first; "
          f"set-up {trl['setup_s']:.1f}s)")
    print(f"[trl] ours is {out['ratio']:.2f}x faster per GRPO step (target >= 3x)")
    emit(args.summary, "trl", "TRL s/GRPO step", round(out["trl_s"], 2), "s")
    emit(args.summary, "trl", "TRL / ours (speed-up)", round(out["ratio"], 2), "x", ">= 3x")
    return out


if __name__ == "__main__":
    main()
