"""TRL's side of ``bench_trl.py``: GRPO steps with ``trl.GRPOTrainer`` on the embedded model.

Runs in ``.bench-venv`` (TRL is never a dependency of closedloop; this file imports nothing from
closedloop). Loads the model folder as a plain HF folder (fp32 weights), builds a GRPOTrainer
(LoRA r=8/alpha 16 on q/k/v/o, beta 0.02 so the KL reference is the adapter-free base, 8
prompts x 4 generations x 32 completion tokens, the whole batch of 32 completions in one pass,
one step per generation batch, TRL's other defaults) and times each optimizer step with a
callback. The spec JSON holds the system message, the prompts and closedloop's prompt ids for
them: each prompt is ``[system, user]``, and the result says whether TRL's chat template gave
the same ids (``prompt_ids_match``). Per step it also times TRL's own parts by wrapping its
methods: ``generate`` (``_generate``), ``reward`` (``_calculate_rewards``), ``score`` (the rest
of ``_generate_and_score_completions``: the old/reference log-prob forwards) and ``update``
(the rest of the step: loss forward, backward, optimizer). Prints one JSON line
``TRL_RESULT {...}``.

Precision: fp32 by default (``GRPOConfig(bf16=False)``; TRL's own default would be bf16).
``--bf16`` is TRL's standard mixed precision, ``GRPOConfig(bf16=True)``: the model stays fp32
and accelerate runs the wrapped model's forward (and TRL's log-prob forwards) under CPU
``torch.autocast(bfloat16)``; the backward follows the autocast graph, the optimizer updates
fp32 LoRA weights. Generation is not covered: ``PeftModel.generate`` calls the base model's own
forward, which accelerate did not wrap, so TRL's decode steps run in plain fp32 even with
``--bf16`` (measured: per step, the completion-length decode forwards in fp32 and only the
policy and reference log-prob forwards under autocast). The result JSON says which
(``"bf16": true/false``) and counts the causal LM's forwards that ran under bf16 autocast and
those that ran in plain fp32 (``"forwards"``, over all steps). TRL's default
``gradient_checkpointing=True`` is kept unless ``--no-gradient-checkpointing`` (reported as
``"gradient_checkpointing"``).

    .bench-venv/bin/python benchmarks/trl_grpo_step.py MODEL_DIR SPEC_JSON [--steps 3]
        [--threads 1] [--completion 32] [--generations 4] [--bf16] [--no-gradient-checkpointing]
        [--mask-truncated]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def reward_parity(completions: list, **_: object) -> list[float]:
    """The shared verifier-free reward: length of the completion text mod 2."""
    out = []
    for c in completions:
        text = c if isinstance(c, str) else c[-1]["content"]
        out.append(float(len(text) % 2))
    return out


def time_method(obj: object, name: str) -> list[float]:
    """Wrap ``obj.name`` with a timer; the list collects each call's seconds."""
    inner = getattr(obj, name)
    calls: list[float] = []

    def timed(*args: object, **kwargs: object) -> object:
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            calls.append(time.perf_counter() - t0)

    setattr(obj, name, timed)
    return calls


def step_split(times: list[float], parts: dict[str, list[float]]) -> dict[str, float]:
    """Mean seconds per step (the first step left out when there are more) in TRL's parts."""
    k = 1 if len(times) > 1 else 0

    def mean(xs: list[float]) -> float:
        xs = xs[k:len(times)]
        return sum(xs) / max(1, len(xs))

    gen, rew = mean(parts["_generate"]), mean(parts["_calculate_rewards"])
    both = mean(parts["_generate_and_score_completions"])
    return {"generate": gen, "reward": rew, "score": both - gen - rew,
            "update": mean(times) - both}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("spec_json")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--completion", type=int, default=32)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--no-gradient-checkpointing", action="store_true",
                    help="turn off TRL's default activation recompute in the backward")
    ap.add_argument("--mask-truncated", action="store_true",
                    help="GRPOConfig(mask_truncated_completions=True)")
    ap.add_argument("--bf16", action="store_true",
                    help="TRL's mixed precision: GRPOConfig(bf16=True), bf16 autocast on CPU")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_DISABLED", "true")
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    with open(args.spec_json, encoding="utf-8") as fh:
        spec = json.load(fh)
    prompts = spec["prompts"]
    rows = [[{"role": "system", "content": spec["system"]}, {"role": "user", "content": p}]
            for p in prompts]
    ds = Dataset.from_list([{"prompt": r} for r in rows])
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    ids_match = [list(tok.apply_chat_template(r, add_generation_prompt=True, tokenize=True,
                                              return_dict=False)) == want
                 for r, want in zip(rows, spec["prompt_ids"], strict=True)]
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    times: list[float] = []
    # Which forwards of the causal LM ran under bf16 autocast (generation's decode steps
    # included): a check of what --bf16 really covers, reported in the result.
    forwards = {"autocast_bf16": 0, "fp32": 0}

    def count_forward(*_: object) -> None:
        on = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        forwards["autocast_bf16" if on else "fp32"] += 1

    model.register_forward_pre_hook(count_forward)

    class Timer(TrainerCallback):
        def on_step_begin(self, *a: object, **k: object) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, *a: object, **k: object) -> None:
            times.append(time.perf_counter() - self.t0)
            print(f"[trl] step {len(times)}: {times[-1]:.2f}s", flush=True)

    n = len(prompts) * args.generations
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(
            output_dir=out, use_cpu=True, bf16=args.bf16, fp16=False,
            per_device_train_batch_size=n, gradient_accumulation_steps=1,
            num_generations=args.generations, steps_per_generation=1,
            max_completion_length=args.completion, temperature=1.0, top_p=1.0,
            beta=0.02, learning_rate=1e-4, max_steps=args.steps, num_iterations=1,
            logging_steps=1000, save_strategy="no", report_to="none",
            dataloader_num_workers=0, seed=0,
            gradient_checkpointing=not args.no_gradient_checkpointing,
            mask_truncated_completions=args.mask_truncated)
        lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, bias="none",
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                          task_type="CAUSAL_LM")
        t0 = time.perf_counter()
        trainer = GRPOTrainer(model=model, reward_funcs=reward_parity, args=cfg,
                              train_dataset=ds, processing_class=tok, peft_config=lora,
                              callbacks=[Timer()])
        setup = time.perf_counter() - t0
        parts = {name: time_method(trainer, name) for name in
                 ("_generate", "_calculate_rewards", "_generate_and_score_completions")}
        trainer.train()
        history = [h for h in trainer.state.log_history if "completions/mean_length" in h]
        mean_len = float(history[-1]["completions/mean_length"]) if history else None
    import trl

    split = step_split(times, parts)
    clipped = history[-1].get("completions/clipped_ratio") if history else None
    print("TRL_RESULT " + json.dumps({"steps_s": times, "setup_s": setup, "split_s": split,
                                      "prompt_ids_match": all(ids_match),
                                      "mask_truncated": bool(cfg.mask_truncated_completions),
                                      "clipped_ratio": clipped,
                                      "trl": trl.__version__, "loss_type": cfg.loss_type,
                                      "bf16": bool(cfg.bf16),
                                      "gradient_checkpointing": bool(cfg.gradient_checkpointing),
                                      "forwards": forwards,
                                      "completion_mean_length": mean_len,
                                      "threads": torch.get_num_threads()}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
