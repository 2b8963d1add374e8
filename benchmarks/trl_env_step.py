"""TRL's side of ``bench_trl_multiturn.py``: GRPO steps of ``trl.GRPOTrainer`` driving the
terminal-repair tasks through TRL's own ``environment_factory`` tool loop.

Runs in ``.bench-venv`` with the repository on ``PYTHONPATH``: the thin wrapper below
(``TerminalTools``) imports closedloop's terminal environment and verifier (they import there:
torch, transformers and the standard library only) and nothing of closedloop's training code.
One ``TerminalTools`` per rollout: ``reset(task_id, seed)`` resets a ``TerminalRepairEnv`` (the
prompt already holds the task's first observation), each tool is one method that calls
``env.step(Action.tool(name, **arguments))`` and returns the observation text (``finish`` and
``abstain`` step the environment's two non-tool action kinds, as closedloop's parser maps them), and
``get_reward`` is the package's clean-room verifier on the exported state once ``finish`` (or
``abstain``) ended the episode, 0.0 otherwise (TRL has no censoring: an episode that ran out of
turns or stopped calling tools scores 0). TRL's loop has no way for an environment to end an
episode: after ``finish`` the model is prompted again, and a tool it calls then answers
``episode_over`` (counted as ``calls_after_end``; closedloop's episode ends at ``finish``).

The scaffold is closedloop's: the same system message (system prompt and tools block) and a
chat template that renders closedloop's ChatML tool format (``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>`` in the assistant turn, tool results as ``<|im_start|>user
<tool_response>...</tool_response><|im_end|>``); tool calls are parsed with TRL's Qwen3
response template (the same ``<tool_call>`` JSON). The result says whether TRL's prompt ids
equal closedloop's (``prompt_ids_match``).

Step budget: TRL's first generation plus at most ``max_turns - 1`` tool-calling iterations
(``max_tool_calling_iterations``), so at most ``max_turns`` model turns, as closedloop's
``environment.max_turns``. Each turn stops at ``</tool_call>`` or after the spec's
``max_action_tokens`` (``generation_kwargs``, as closedloop's turn; ``stop_at_tool_call``),
``max_completion_length`` bounds the whole multi-turn completion (model and tool tokens
together), and every turn re-prefills the whole context. One optimizer step per generation batch
of ``len(tasks) x G`` completions, in micro-batches of ``--micro`` (gradient accumulation),
TRL's other defaults.

Per step: TRL's step time (callback), ``generate`` (``_generate``, which runs the tool loop),
``environment`` (the wrapper's own time in reset and tools), ``reward``, ``score`` and
``update`` (as in ``trl_grpo_step.py``), model turns, action and observation tokens (from the
tool mask). Prints ``TRL_RESULT {...}``.

    PYTHONPATH=. .bench-venv/bin/python benchmarks/trl_env_step.py MODEL_DIR SPEC_JSON
        [--steps 2] [--threads 1] [--generations 4] [--budget 2048] [--micro 8] [--bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

from trl_grpo_step import step_split, time_method

# closedloop's ChatML tool format as a Jinja chat template (no whitespace control: every
# newline below is literal output).
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% elif m['role'] == 'assistant' %}"
    "<|im_start|>assistant\n{{ m['content'] or '' }}"
    "{% for tc in (m['tool_calls'] or []) %}"
    "<tool_call>{{ {'name': tc['function']['name'], 'arguments': tc['function']['arguments']}"
    " | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

STATS: list[dict[str, Any]] = []  # one record per rollout (reset), in order
STOP = "</tool_call>"


def stop_at_tool_call(tokenizer: Any) -> None:
    """Give transformers' ``generate`` the tokenizer its ``stop_strings`` need and end each
    stopped turn with the end-of-turn id.

    TRL calls ``generate`` without a tokenizer, and TRL assumes a turn ends with EOS (it closes
    the assistant message by appending the tool response after EOS). closedloop stops a turn at
    ``</tool_call>`` and its template closes the message with ``<|im_end|>``; here generate
    stops at the same string, and one column of the pad id (``<|im_end|>``, the id finished
    rows are already padded with) is appended, so the row that stopped last is closed too (a row
cut by the turn limit also gets it: TRL would otherwise read no end of turn at all).
    """
    import torch
    from transformers.generation.utils import GenerationMixin

    inner = GenerationMixin.generate

    def generate(self: Any, *a: Any, **k: Any) -> Any:
        k.setdefault("tokenizer", tokenizer)
        out = inner(self, *a, **k)
        pad = torch.full((out.shape[0], 1), tokenizer.pad_token_id, dtype=out.dtype)
        return torch.cat([out, pad.to(out.device)], dim=1)

    GenerationMixin.generate = generate  # type: ignore[method-assign]


class TerminalTools:
    """One rollout's terminal environment, its tools as methods (module doc)."""

    def __init__(self) -> None:
        from closedloop.envs.terminal.package import make_env
        from closedloop.envs.terminal.verifier import Verifier

        self._env = make_env()
        self._verifier = Verifier()
        self._task = ""
        self._done = False
        self._stats: dict[str, Any] = {}

    def reset(self, task_id: str, seed: int, **_: Any) -> None:
        """Reset the environment to the task (its first observation is already the prompt)."""
        t0 = time.perf_counter()
        self._env.reset(task_id, int(seed))
        self._task, self._done = task_id, False
        self._stats = {"task": task_id, "tool_calls": 0, "env_s": 0.0, "finished": False,
                       "calls_after_end": 0}
        STATS.append(self._stats)
        self._stats["env_s"] += time.perf_counter() - t0

    def _step(self, name: str, **arguments: Any) -> str:
        from closedloop.contracts import Action
        from closedloop.contracts.action import RESERVED_NAMES

        t0 = time.perf_counter()
        try:
            self._stats["tool_calls"] += 1
            if self._done:
                self._stats["calls_after_end"] += 1
                return '{"error": "episode_over"}'
            tr = self._env.step(Action(RESERVED_NAMES.get(name, "tool"), name, dict(arguments)))
            self._done = tr.done
            self._stats["finished"] = tr.done
            return tr.observation
        finally:
            self._stats["env_s"] += time.perf_counter() - t0

    def list_dir(self, path: str) -> str:
        """List files.

        Args:
            path: the folder to list.
        """
        return self._step("list_dir", path=path)

    def read_file(self, path: str) -> str:
        """Read a file.

        Args:
            path: the file to read.
        """
        return self._step("read_file", path=path)

    def write_file(self, path: str, content: str) -> str:
        """Overwrite a file with content.

        Args:
            path: the file to write.
            content: its new content.
        """
        return self._step("write_file", path=path, content=content)

    def replace(self, path: str, old: str, new: str) -> str:
        """Replace the exact text old with new in a file.

        Args:
            path: the file to edit.
            old: the exact text to replace.
            new: the text to put instead.
        """
        return self._step("replace", path=path, old=old, new=new)

    def run(self, command: str) -> str:
        """Run one of the task's commands.

        Args:
            command: the command's name.
        """
        return self._step("run", command=command)

    def finish(self) -> str:
        """Declare the task done."""
        return self._step("finish")

    def abstain(self) -> str:
        """Refuse a task that cannot be done safely or honestly."""
        return self._step("abstain")

    def get_reward(self) -> float:
        """The verifier's task_success on the exported state of an ended episode, else 0."""
        if not self._done:
            return 0.0
        score = self._verifier.score_or_quarantine(self._task, self._env.export_state())
        return float(score.success or 0.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("spec_json")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--budget", type=int, default=2048, help="max_completion_length")
    ap.add_argument("--micro", type=int, default=8, help="per_device_train_batch_size")
    ap.add_argument("--bf16", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_DISABLED", "true")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    torch.set_num_threads(args.threads)
    with open(args.spec_json, encoding="utf-8") as fh:
        spec = json.load(fh)
    tasks = spec["tasks"]
    rows = [{"prompt": [{"role": "system", "content": spec["system"]},
                        {"role": "user", "content": t["observation"]}],
             "task_id": t["task_id"], "seed": int(t["seed"])} for t in tasks]
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    tok.chat_template = CHAT_TEMPLATE
    tok.response_template = qwen3_template
    ids_match = [list(tok.apply_chat_template(r["prompt"], add_generation_prompt=True,
                                              tokenize=True, return_dict=False)) == t["prompt_ids"]
                 for r, t in zip(rows, tasks, strict=True)]
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    stop_at_tool_call(tok)
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a: object, **k: object) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, *a: object, **k: object) -> None:
            times.append(time.perf_counter() - self.t0)
            print(f"[trl-env] step {len(times)}: {times[-1]:.2f}s", flush=True)

    batch = len(tasks) * args.generations
    args.micro = min(args.micro, batch)
    rollouts: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(
            output_dir=out, use_cpu=True, bf16=args.bf16, fp16=False,
            per_device_train_batch_size=args.micro,
            gradient_accumulation_steps=batch // args.micro,
            num_generations=args.generations,
            max_completion_length=args.budget, temperature=float(spec["temperature"]),
            top_p=1.0, beta=0.02, learning_rate=float(spec["learning_rate"]),
            max_steps=args.steps, num_iterations=1, logging_steps=1, save_strategy="no",
            report_to="none", dataloader_num_workers=0, seed=0,
            max_tool_calling_iterations=int(spec["max_turns"]) - 1,
            generation_kwargs={"stop_strings": [STOP],
                               "max_new_tokens": int(spec["max_action_tokens"])})
        from peft import LoraConfig

        lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, bias="none",
                          target_modules=list(spec["lora_targets"]), task_type="CAUSAL_LM")
        trainer = GRPOTrainer(model=model, args=cfg, train_dataset=Dataset.from_list(rows),
                              processing_class=tok, peft_config=lora,
                              environment_factory=TerminalTools, callbacks=[Timer()])
        parts = {name: time_method(trainer, name) for name in
                 ("_generate", "_calculate_rewards", "_generate_and_score_completions")}
        inner_generate = trainer._generate

        def generate(*a: Any, **k: Any) -> Any:
            result = inner_generate(*a, **k)
            completion_ids, tool_mask, completions = result[1], result[2], result[3]
            mask = tool_mask or [[1] * len(ids) for ids in completion_ids]
            new = STATS[-len(completions):]  # TRL resets each rollout's environment before this
            rollouts.append({
                "action_tokens": sum(sum(m) for m in mask),
                "observation_tokens": sum(len(m) - sum(m) for m in mask),
                "model_turns": sum(sum(1 for msg in c if msg.get("role") == "assistant")
                                   for c in completions),
                "tool_calls": sum(s["tool_calls"] for s in new),
                "finished": sum(1 for s in new if s["finished"]),
                "calls_after_end": sum(s["calls_after_end"] for s in new),
                "env_s": sum(s["env_s"] for s in new), "rollouts": len(completions)})
            print(f"[trl-env] rollout {len(rollouts)}: {json.dumps(rollouts[-1])}", flush=True)
            return result

        trainer._generate = generate
        trainer.train()
        rewards = [h.get("reward") for h in trainer.state.log_history if "reward" in h]
    import trl

    split = step_split(times, parts)
    k = 1 if len(rollouts) > 1 else 0
    env_s = sum(r["env_s"] for r in rollouts[k:]) / max(1, len(rollouts[k:]))
    split = {"generation": split["generate"] - env_s, "environment": env_s,
             "reward": split["reward"], "score": split["score"], "update": split["update"]}
    print("TRL_RESULT " + json.dumps({
        "steps_s": times, "split_s": split, "rollouts": rollouts, "rewards": rewards,
        "prompt_ids_match": all(ids_match), "trl": trl.__version__, "bf16": bool(cfg.bf16),
        "budget": args.budget, "micro": args.micro, "loss_type": cfg.loss_type,
        "threads": torch.get_num_threads()}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
