"""A tiny Llama that solves a few train tasks about half the time: the policy of the crash test.

A random tiny model never closes a tool call, so every episode it plays is censored and every
group is discarded: an RL run on it never updates, and "the final weights equal an uninterrupted
run's" would hold trivially. This module gives a tiny model a *coin-flip competence* on a handful
of train tasks, so that sibling episodes of one group both succeed and fail and the update has
non-zero advantages:

- demonstrations come from the real collector and renderer (the run's own threading and token
  ids): for every task, the expert's episode (gold actions, then ``finish``: success) and a
  give-up episode (``finish`` at once: a clean, uncensored failure);
- a full-parameter supervised fit (plain AdamW on the token-mean NLL of the action tokens,
  ``closedloop.learn.sft.sft_backward``) memorizes both, so the first action's branch token is
  close to 50/50 and everything after it is nearly deterministic;
- :func:`sample_outcomes` checks the result the way a run samples (``HFGenerator`` through the
  collector at temperature 1.0).

The model is saved as a local Hugging Face folder, which a run config's ``model:`` accepts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from closedloop.contracts import Action, Episode, SamplerConfig, sha256_hex
from closedloop.contracts.package import EnvPackage, ScriptedPolicyLike
from closedloop.engine import HFGenerator
from closedloop.envs.terminal.package import terminal_package
from closedloop.learn.sft import sft_backward
from closedloop.policy import (
    ChatRenderer,
    build_tiny_model,
    load_embedded_tokenizer,
    weights_checksum,
)
from closedloop.rollout.source import ActionSource, GeneratorSource, ScriptedSource
from closedloop.training.wiring import CollectorParts, build_manifest, make_collector, make_renderer

__all__ = ["GiveUpPolicy", "TinyAgent", "build_tiny_agent", "demonstrations",
           "sample_outcomes", "teach"]


class GiveUpPolicy:
    """Calls ``finish`` at once: an uncensored, verifier-scored failure."""

    def act(self, observation: str) -> Action:
        """Return ``finish`` whatever the observation."""
        return Action.finish()


@dataclass(frozen=True)
class TinyAgent:
    """Where the taught model was saved and how it did.

    losses: the supervised loss per optimizer step. outcomes: per task, the task successes of
    ``group_size`` episodes sampled at temperature 1.0 (``None`` for a censored episode).
    """

    folder: Path
    losses: tuple[float, ...]
    outcomes: dict[str, list[float | None]]

    @property
    def mixed_tasks(self) -> list[str]:
        """Tasks whose sampled group holds both a success and a scored failure."""
        return [task for task, scores in self.outcomes.items()
                if 1.0 in scores and any(s is not None and s < 1.0 for s in scores)]


def _renderer(tokenizer: Any, package: EnvPackage | None = None) -> ChatRenderer:
    renderer: ChatRenderer = make_renderer(tokenizer, package)
    return renderer


def _collect(source: ActionSource, renderer: ChatRenderer, checksum: str,
             groups: Sequence[tuple[str, str, int, int]], sampler: SamplerConfig,
             max_turns: int, max_action_tokens: int,
             package: EnvPackage | None = None) -> list[list[Episode]]:
    package = package or terminal_package()
    manifest = build_manifest(policy_version="v0000", weight_checksum=checksum,
                              tokenizer_revision=sha256_hex("tiny-agent"), renderer=renderer,
                              sampler=sampler, step_budget=max_turns,
                              max_action_tokens=max_action_tokens, model_id="tiny-agent")
    collector = make_collector(source, manifest,
                               CollectorParts(renderer, package.verifier(), "tiny-agent", None,
                                              max_turns, package))
    leases = [collector.make_lease(gid, task, seed, size) for gid, task, seed, size in groups]
    return [list(g.episodes) for g in collector.collect(leases)]


def demonstrations(task_ids: Sequence[str], renderer: ChatRenderer, seeds: Sequence[int],
                   max_turns: int, give_up_tasks: Sequence[str] = (),
                   package: EnvPackage | None = None) -> list[Episode]:
    """Expert and give-up episodes of ``task_ids`` and give-up episodes of ``give_up_tasks``
    at every seed, through the real collector (``package``: default the terminal tasks)."""
    pkg = package or terminal_package()

    def make_policy(task_id: str, key: str) -> ScriptedPolicyLike:
        if key.startswith("give-up"):
            return GiveUpPolicy()
        return pkg.scripted_policy("expert", task_id, 0)

    source = ScriptedSource(make_policy, renderer.encode, build="tiny-agent-demos")
    plays = [("expert", t) for t in task_ids] + [("give-up", t) for t in task_ids]
    plays += [("give-up", t) for t in give_up_tasks]
    groups = [(f"{kind}-{i}-{seed}", task, seed, 1) for i, (kind, task) in enumerate(plays)
              for seed in seeds]
    return [ep for group in _collect(source, renderer, sha256_hex("scripted"), groups,
                                     SamplerConfig(), max_turns, 0, pkg) for ep in group]


def teach(model: torch.nn.Module, episodes: Sequence[Episode], pad_id: int, *, steps: int,
          learning_rate: float, target_loss: float) -> list[float]:
    """Full-parameter AdamW on the action tokens of ``episodes`` (the whole set each step).

    Stops after ``steps`` steps or once the token-mean NLL is below ``target_loss``.
    """
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    losses: list[float] = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss, _ = sft_backward(model, list(episodes), pad_id, micro_batch_size=len(episodes))
        optimizer.step()
        losses.append(loss)
        if loss < target_loss:
            break
    model.eval()
    return losses


def sample_outcomes(model: Any, tokenizer: Any, task_ids: Sequence[str], *, group_size: int,
                    seed: int, max_turns: int, max_action_tokens: int,
                    package: EnvPackage | None = None) -> dict[str, list[float | None]]:
    """Task success of ``group_size`` episodes per task sampled at temperature 1.0."""
    renderer = _renderer(tokenizer, package)
    checksum = weights_checksum(model)
    sampler = SamplerConfig(temperature=1.0)
    generator = HFGenerator(model, tokenizer, weight_checksum=checksum, seed=seed)
    source = GeneratorSource(generator, renderer.action_text, sampler, max_action_tokens, "hf")
    groups = [(f"probe-{i}", task, 11, group_size) for i, task in enumerate(task_ids)]
    collected = _collect(source, renderer, checksum, groups, sampler, max_turns,
                         max_action_tokens, package)
    return {task: [ep.trajectory.task_success for ep in eps]
            for task, eps in zip(task_ids, collected, strict=True)}


def build_tiny_agent(folder: Path, task_ids: Sequence[str], give_up_tasks: Sequence[str] = (),
                     *, seed: int = 0, hidden: int = 64, demo_seeds: Sequence[int] = (11,),
                     max_turns: int = 6, max_action_tokens: int = 64, steps: int = 200,
                     learning_rate: float = 1e-2, target_loss: float = 0.012,
                     probe_group_size: int = 8, package: EnvPackage | None = None) -> TinyAgent:
    """Build, teach, probe and save the tiny agent in ``folder`` (see the module docstring).

    ``task_ids`` get expert and give-up demonstrations (the coin-flip competence);
    ``give_up_tasks`` (e.g. the held-out set) only give-up ones, so the agent ends those
    episodes cleanly and they are scored (0) rather than censored. The probe samples
    ``probe_group_size`` episodes of each of ``task_ids``. ``package``: the environment
    (default: the terminal tasks), whose scaffold, expert and verifier are used.
    """
    tokenizer = load_embedded_tokenizer()
    model = build_tiny_model(tokenizer, seed=seed, hidden=hidden, layers=2, init_std=0.3)
    renderer = _renderer(tokenizer, package)
    episodes = demonstrations(task_ids, renderer, demo_seeds, max_turns, give_up_tasks,
                              package)
    losses = teach(model, episodes, int(tokenizer.pad_token_id or 0), steps=steps,
                   learning_rate=learning_rate, target_loss=target_loss)
    outcomes = sample_outcomes(model, tokenizer, task_ids, group_size=probe_group_size,
                               seed=seed, max_turns=max_turns,
                               max_action_tokens=max_action_tokens, package=package)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return TinyAgent(folder, tuple(losses), outcomes)
