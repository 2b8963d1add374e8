"""Benchmark (not a test): ``Trainer.step`` throughput vs a raw forward+backward (issue 4).

One batch of ``--episodes`` synthetic multi-turn episodes (lengths spread over ``--min-len`` ..
``--max-len`` ids; a 200-id prompt then turns of 40 observation + 24 action ids, actions masked
in) on the embedded model with a LoRA adapter (r=8, alpha=16, q/k/v/o). Three modes, alternated
in rotated order, all on the same batch and the same trainable LoRA parameters:

- ``trainer+ref``: ``Trainer.step`` with reinforce_with_kl, KL (k3, beta 0.02) to the
  adapter-free reference (``reference=model.disable_adapter``: one extra no-grad forward);
- ``trainer``: ``Trainer.step`` with kl_beta=0 and no reference (the policy forward+backward);
- ``raw``: plain ``model(input_ids, attention_mask).logits`` -> log_softmax -> gather -> masked
  sum -> backward, same micro-batches (4 rows, cropped to their longest row), no optimizer;
- ``raw_action``: the same, but only the action positions go through the vocabulary head (what
  the trainer computes), so the gap to it is the trainer's own overhead.

Tokens/s counts every real (non-pad) id of the batch. The headline is ``trainer`` as a fraction
of ``raw`` (target >= 90%); ``trainer+ref`` shows what the reference pass adds.

    .venv/bin/python benchmarks/bench_trainer.py [--episodes 8] [--min-len 256] [--max-len 384]
        [--repeats 3] [--threads 1] [--quick] [--tiny]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine_label, median, rotate, set_threads

from closedloop.contracts.batch import TrainingBatch
from closedloop.learn.trainer import Trainer, TrainerConfig
from closedloop.policy import attach_lora, build_tiny_model, load_model

PROMPT, OBS, ACT = 200, 40, 24


def synthetic_batch(lengths: list[int], vocab: int, seed: int = 0) -> TrainingBatch:
    """Right-padded episodes: prompt, then (obs, action) turns; actions are the targets."""
    g = torch.Generator().manual_seed(seed)
    b, t = len(lengths), max(lengths)
    ids = torch.randint(100, vocab, (b, t), generator=g)
    attn = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t)
    turns = torch.full((b, t), -1, dtype=torch.long)
    for i, n in enumerate(lengths):
        attn[i, :n] = 1
        for pos in range(PROMPT, n):
            k, off = divmod(pos - PROMPT, OBS + ACT)
            if off >= OBS:
                mask[i, pos], turns[i, pos] = 1.0, k
    ids = ids * attn
    beh = torch.where(mask > 0, torch.full_like(mask, -2.0), torch.zeros_like(mask))
    return TrainingBatch(ids, attn, mask, beh, beh.clone(), turns,
                         tuple(f"e{i}" for i in range(b)), tuple(f"g{i // 4}" for i in range(b)))


def micro_batches(batch: TrainingBatch, micro: int
                  ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
    """Yield (row indices, ids, attention mask, length) per micro-batch, trimmed to its
    longest row, as the trainer slices them."""
    n = batch.token_ids_B_T.shape[0]
    for lo in range(0, n, micro):
        idx = torch.arange(lo, min(lo + micro, n))
        length = int(batch.attention_mask_B_T[idx].sum(1).max())
        yield (idx, batch.token_ids_B_T[idx, :length], batch.attention_mask_B_T[idx, :length],
               length)


def raw_step(model: Any, batch: TrainingBatch, micro: int) -> None:
    """Plain forward+backward over the same micro-batches; log-probs of every next id."""
    model.train()
    model.zero_grad(set_to_none=True)
    for _, ids, attn, _ in micro_batches(batch, micro):
        logits = model(input_ids=ids, attention_mask=attn).logits
        lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])
        (lp.squeeze(-1) * attn[:, 1:]).sum().backward()


def raw_action_step(model: Any, batch: TrainingBatch, micro: int) -> None:
    """Plain forward+backward that projects only the action positions onto the vocabulary
    (decoder -> lm_head on the masked hidden states -> log_softmax -> gather -> sum)."""
    model.train()
    model.zero_grad(set_to_none=True)
    lm = model.get_base_model()
    for idx, ids, attn, length in micro_batches(batch, micro):
        sel = batch.action_mask_B_T[idx, 1:length].bool()
        hidden = lm.model(input_ids=ids, attention_mask=attn).last_hidden_state
        logits = lm.lm_head(hidden[:, :-1][sel]).float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:][sel][:, None])
        lp.sum().backward()


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=384)
    ap.add_argument("--micro", type=int, default=4, help="micro-batch rows (trainer and raw)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--summary")
    args = ap.parse_args(argv)
    if args.quick:
        args.episodes, args.min_len, args.max_len, args.repeats = 4, 240, 300, 1
    set_threads(args.threads)
    print(f"[trainer] machine: {machine_label()}")
    loaded = load_model(None)
    base = build_tiny_model(loaded.tokenizer) if args.tiny else loaded.model
    model = attach_lora(base, r=8, alpha=16)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    step = (args.max_len - args.min_len) / max(1, args.episodes - 1)
    lengths = [int(args.min_len + i * step) for i in range(args.episodes)]
    batch = synthetic_batch(lengths, vocab)
    n_tok = int(batch.attention_mask_B_T.sum())
    n_act = int(batch.action_mask_B_T.sum())
    adv = torch.linspace(-1, 1, args.episodes)
    with_ref = Trainer(model, TrainerConfig(micro_batch_size=args.micro, kl_beta=0.02),
                       reference=model.disable_adapter)
    no_ref = Trainer(model, TrainerConfig(micro_batch_size=args.micro, kl_beta=0.0))
    modes = {"trainer+ref": lambda: with_ref.step(batch, adv),
             "trainer": lambda: no_ref.step(batch, adv),
             "raw": lambda: raw_step(model, batch, args.micro),
             "raw_action": lambda: raw_action_step(model, batch, args.micro)}
    print(f"[trainer] batch: {args.episodes} episodes, lengths {lengths[0]}..{lengths[-1]}, "
          f"{n_tok} tokens ({n_act} action tokens), micro-batches of {args.micro}; LoRA r=8")
    secs: dict[str, list[float]] = {m: [] for m in modes}
    for rep in range(args.repeats):
        for name in rotate(list(modes), rep):
            t0 = time.perf_counter()
            modes[name]()
            dt = time.perf_counter() - t0
            secs[name].append(dt)
            print(f"[trainer] rep {rep} {name:12s} {dt:7.2f}s  {n_tok / dt:7.1f} tokens/s",
                  flush=True)
    out: dict[str, float] = {}
    for name in modes:
        out[name] = n_tok / median(secs[name])
        print(f"[trainer] {name:12s} median {out[name]:7.1f} tokens/s")
        emit(args.summary, "trainer", f"{name} tokens/s", round(out[name], 1), "tok/s")
    for name in ("trainer", "trainer+ref"):
        for raw in ("raw", "raw_action"):
            frac = median([r / s for r, s in zip(secs[raw], secs[name], strict=True)])
            out[f"{name}/{raw}"] = frac
            print(f"[trainer] {name} tokens/s as a fraction of {raw} fwd+bwd: {100 * frac:.0f}%"
                  + (" (target >= 90%)" if name == "trainer" else ""))
            emit(args.summary, "trainer", f"{name} / {raw} fwd+bwd", round(100 * frac, 1), "%",
                 ">= 90%" if name == "trainer" else "")
    return out


if __name__ == "__main__":
    main()
