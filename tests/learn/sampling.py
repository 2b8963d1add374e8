"""Episodes sampled by the real HF generator and collector from a tiny model (audit and
update-contract tests)."""

from __future__ import annotations

from typing import Any

from closedloop.contracts import Episode, SamplerConfig, sha256_hex
from closedloop.engine import HFGenerator
from closedloop.envs.terminal.package import AGENT_TOOLS, SYSTEM_PROMPT
from closedloop.envs.terminal.task_sets import list_tasks
from closedloop.envs.terminal.verifier import Verifier
from closedloop.policy import ChatRenderer
from closedloop.policy.weights import weights_checksum
from closedloop.rollout.source import GeneratorSource
from closedloop.training.wiring import CollectorParts, build_manifest, make_collector


def sample_episodes(model: Any, tok: Any, sampler: SamplerConfig, *, siblings: int,
                    max_turns: int, run_id: str) -> tuple[str, list[Episode]]:
    """One group of ``siblings`` episodes on a train task; returns (weight checksum, episodes)."""
    checksum = weights_checksum(model)
    renderer = ChatRenderer(tok, SYSTEM_PROMPT, list(AGENT_TOOLS))
    manifest = build_manifest(policy_version="v0000", weight_checksum=checksum,
                              tokenizer_revision=sha256_hex("t"), renderer=renderer,
                              sampler=sampler, step_budget=8, max_action_tokens=12,
                              model_id="tiny")
    source = GeneratorSource(HFGenerator(model, tok, weight_checksum=checksum, seed=1),
                             renderer.action_text, sampler, 12, "hf")
    collector = make_collector(source, manifest,
                               CollectorParts(renderer, Verifier(), run_id, None, max_turns))
    task = list_tasks(split="train")[3]
    groups = collector.collect([collector.make_lease("g", task, 11, siblings)])
    return checksum, [ep for g in groups for ep in g.episodes]
