"""The supervised side of a training run: the warm start (SFT on noisy-expert demonstrations,
merged into the base, so π_ref is the initial SFT policy) and the SFT-only control (more
supervised steps on the trainer's policy, published as the final version)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from closedloop.contracts import Episode, content_hash
from closedloop.contracts.package import ScriptedPolicyLike
from closedloop.engine import drop_bf16_copies, release_free_memory
from closedloop.errors import RunStateError
from closedloop.learn.sft import supervised_warm_start
from closedloop.policy import attach_lora
from closedloop.policy.registry import version_name
from closedloop.progress import Progress, log, phase
from closedloop.rollout.source import ScriptedSource
from closedloop.rollout.work_orders import GroupSpec
from closedloop.training.collection import collect_to_trace
from closedloop.training.run import Run, manifest_for, publish
from closedloop.training.trainer_role import adapter_state


def load_warm_start(sft_dir: Path) -> tuple[dict[str, torch.Tensor], int]:
    """The run's SFT adapter (``adapter.pt``) and its trained action tokens (``result.json``);
    ``RunStateError`` naming the damaged file and how to recover otherwise."""
    adapter_file, result_file = sft_dir / "adapter.pt", sft_dir / "result.json"
    recovery = (f"delete {sft_dir} to train the warm start again (and checkpoints/ and "
                "registry/, which were trained from it)")
    try:
        meta = json.loads(result_file.read_text(encoding="utf-8"))
        tokens = int(meta["trained_action_tokens"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RunStateError(result_file, f"the warm start's record is unreadable "
                            f"({type(exc).__name__}: {exc})", recovery) from None
    try:
        state: dict[str, torch.Tensor] = torch.load(adapter_file, weights_only=True)
    except Exception as exc:  # torch raises several types for a damaged file
        raise RunStateError(adapter_file, f"the warm-start adapter does not load "
                            f"({type(exc).__name__}: {exc})", recovery) from None
    return state, tokens


def warm_start(run: Run) -> None:
    """SFT on noisy-expert demonstrations, merged into the base (π_ref = initial SFT); an
    existing ``sft/adapter.pt`` is reused. Runs before ``attach_roles``."""
    cfg = run.cfg
    adapter_file = run.dir / "sft" / "adapter.pt"
    model = attach_lora(run.policy.model, r=cfg.training.lora_rank,
                        alpha=cfg.training.lora_alpha, seed=cfg.training.seed,
                        target_modules=tuple(cfg.training.lora_targets))
    if adapter_file.is_file():
        state, run.state.sft_tokens = load_warm_start(adapter_file.parent)
        model.load_state_dict(state, strict=False)
        log("warm start: reusing the run's SFT adapter")
    else:
        with phase("warm start"):
            _train_warm_start(run, model, adapter_file)
        release_free_memory()  # the SFT's freed activations, kept by the tuned allocator
    run.policy.model = model.merge_and_unload()
    # the merge writes the base weights through .data, which a cached bf16 copy cannot see
    drop_bf16_copies(run.policy.model)


def _train_warm_start(run: Run, model: Any, adapter_file: Path) -> None:
    """Collect the demonstrations, train the SFT adapter on them and store it (its record
    first, the adapter last and atomically)."""
    cfg = run.cfg.sft
    demos = collect_demonstrations(run, cfg.demonstrations)
    with Progress(cfg.epochs * len(demos), "sft", "ep") as bar:
        result = supervised_warm_start(
            model, demos, run.policy.pad_id, epochs=cfg.epochs, batch_size=cfg.batch_size,
            learning_rate=cfg.learning_rate, seed=run.cfg.training.seed,
            precision=run.ctx.precision.precision, progress=bar.update)
    run.state.sft_tokens = result.trained_action_tokens
    meta = {"optimizer_steps": result.optimizer_steps, "episodes": result.episodes,
            "trained_action_tokens": result.trained_action_tokens,
            "losses": list(result.losses)}
    # result.json first, the adapter last and atomically: an adapter never lacks its
    # record, so a resume either reuses both or trains again
    run.ctx.directory.write_json("sft/result.json", meta)
    tmp = adapter_file.with_suffix(".pt.tmp")
    torch.save(adapter_state(model), tmp)
    os.replace(tmp, adapter_file)
    run.log_metrics("sft", meta)
    log(f"warm start: {result.optimizer_steps} steps on {result.episodes} "
        f"demonstrations, {result.trained_action_tokens} action tokens, loss "
        f"{result.losses[0]:.3f} -> {result.losses[-1]:.3f}")


def collect_demonstrations(run: Run, n: int, offset: int = 0,
                           name: str = "sft-demos") -> list[Episode]:
    """Noisy-expert episodes on the demonstration tasks (other instances of the train
    templates, ``closedloop.training.run._demo_tasks``), through the same collector, verifier
    step and renderer."""
    rate, seed = run.cfg.sft.noise_rate, run.cfg.training.seed
    package, demo_tasks = run.ctx.package, run.ctx.tasks.demo

    def make_policy(task_id: str, key: str) -> ScriptedPolicyLike:
        return package.scripted_policy(
            "noisy", task_id, int(content_hash([seed, offset, key])[7:15], 16), rate)

    source = ScriptedSource(make_policy, run.policy.renderer.encode, build="scripted-noisy")
    manifest = manifest_for(run, "scripted", demo=True)
    tasks = [demo_tasks[i % len(demo_tasks)] for i in range(n)]
    path = run.ctx.directory.trace(name)
    path.unlink(missing_ok=True)
    groups = collect_to_trace(run, source, manifest, path, [
        GroupSpec(f"{name}-{i:04d}", task, 1000 + offset + i, 1) for i, task in enumerate(tasks)],
        "demos")
    episodes = [ep for g in groups for ep in g.episodes]
    solved = sum(1 for ep in episodes if (ep.trajectory.task_success or 0) >= 1)
    log(f"demonstrations: {len(episodes)} episodes, {solved} solved")
    return episodes


def sft_only(run: Run, max_tokens: int, label: str) -> dict[str, Any]:
    """The SFT-only control: more supervised steps on fresh demonstrations (the trainer's
    policy), stopping at ``max_tokens`` trained action tokens (matched to an RL arm), then
    publish the result as the final version. ``max_tokens == 0`` (the RL arm trained on
    nothing) trains nothing.
    """
    trained, steps = 0, 0
    if max_tokens > 0:
        with phase("sft-only"):
            trained, steps = _train_sft_only(run, max_tokens, label)
    publish(run, version_name(run.cfg.training.rl_steps))
    meta = {"optimizer_steps": steps, "trained_action_tokens": trained,
            "target_tokens": max_tokens}
    run.log_metrics("sft_only", meta)
    return meta


def _train_sft_only(run: Run, max_tokens: int, label: str) -> tuple[int, int]:
    """Supervised steps on fresh demonstrations until ``max_tokens`` trained action tokens;
    returns (trained tokens, optimizer steps)."""
    cfg = run.cfg.sft
    trainer = run.roles()[0]
    demos = collect_demonstrations(run, cfg.demonstrations, offset=10_000,
                                   name=f"sft-only-{label}")
    with Progress(max_tokens, "sft-only", "tok") as bar:
        result = supervised_warm_start(
            trainer.model, demos, run.policy.pad_id, epochs=max(1, cfg.epochs * 4),
            batch_size=cfg.batch_size, learning_rate=run.cfg.training.learning_rate,
            seed=run.cfg.training.seed + 7, max_tokens=max_tokens,
            precision=run.ctx.precision.precision)
        bar.update(min(max_tokens, result.trained_action_tokens))
    return result.trained_action_tokens, result.optimizer_steps
