"""Partial rollouts: an episode paused at a turn budget and resumed under the same weights
samples exactly the uninterrupted episode (its environment restored from the segment's
snapshot, its stream and context continued; the tiny agent plays several turns per episode);
the segment records carry their fields; resumed by another collector under another version
(a new session prefilling the recorded context ids, no cache carried over) it is labelled
mixed-policy, each turn naming its own version."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from closedloop.contracts import SamplerConfig, sha256_hex
from closedloop.engine import HFGenerator
from closedloop.envs.terminal.package import terminal_package
from closedloop.envs.terminal.task_sets import build_task_sets
from closedloop.policy import load_model
from closedloop.rollout.segments import SegmentStore
from closedloop.rollout.source import GeneratorSource
from closedloop.rollout.verifier_step import Rollout
from closedloop.training.wiring import CollectorParts, build_manifest, make_collector, make_renderer
from tests.conftest import HELDOUT_TASKS, SEED, TRAIN_TASKS

pytestmark = pytest.mark.slow  # needs the tiny agent (taught once per session, ~20 s)

SAMPLER = SamplerConfig(temperature=1.0)


@pytest.fixture(scope="module")
def agent(tiny_agent_dir: Path) -> dict[str, Any]:
    loaded = load_model(str(tiny_agent_dir))
    package = terminal_package()
    renderer = make_renderer(loaded.tokenizer, package)
    tasks = build_task_sets(TRAIN_TASKS, HELDOUT_TASKS, seed=SEED).train_ids
    return {"loaded": loaded, "package": package, "renderer": renderer, "tasks": tasks}


def collector(agent: dict[str, Any], version: str = "v0000") -> Any:
    loaded, renderer = agent["loaded"], agent["renderer"]
    manifest = build_manifest(policy_version=version, weight_checksum=loaded.weight_checksum,
                              tokenizer_revision=sha256_hex("tiny"), renderer=renderer,
                              sampler=SAMPLER, step_budget=6, max_action_tokens=64,
                              model_id="tiny-agent")
    gen = HFGenerator(loaded.model, loaded.tokenizer, weight_checksum=loaded.weight_checksum)
    source = GeneratorSource(gen, renderer.action_text, SAMPLER, 64, "hf")
    return make_collector(source, manifest, CollectorParts(
        renderer, agent["package"].verifier(), "seg-test", None, 6, agent["package"],
        sampling_salt=SEED))


def by_episode(rollouts: dict[str, Rollout]) -> dict[str, Any]:
    return {k: ([list(t.action_token_ids) for t in r.turns], [t.observation for t in r.turns],
                [t.state_after for t in r.turns], r.termination, r.final_state_hash)
            for k, r in rollouts.items()}


def test_a_paused_and_resumed_episode_is_the_uninterrupted_one(agent: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    whole_c = collector(agent)
    leases = [whole_c.make_lease(f"g{i}", t, 11, 4) for i, t in enumerate(agent["tasks"])]
    whole = {r.episode_id: r for g in whole_c.rollout(leases) for r in g.rollouts}

    paused_c = collector(agent)
    store = SegmentStore()
    first = paused_c.rollout_segment(leases, turn_budget=1, store=store)
    paused = store.take()
    assert paused, "no episode outlived its first turn: nothing was paused"
    rest = paused_c.resume(paused)
    resumed = {**first, **rest}
    assert by_episode(resumed) == by_episode(whole)
    for key, r in rest.items():
        a = [x for t in r.turns for x in t.behavior_logprobs]
        assert a == [x for t in whole[key].turns for x in t.behavior_logprobs]
        assert [t.context_segment_id for t in r.turns] == [0] + [1] * (len(r.turns) - 1)
        assert r.turns[1].continuation_parent == f"{key}#0"
        assert not r.mixed_policy
    seg = store.records[0]
    episode = rest[seg.episode_id]
    assert list(seg.context_token_ids) == episode.turns[0].prompt_token_ids + list(
        episode.turns[0].action_token_ids) + episode.turns[1].prompt_token_ids
    assert seg.continuation_parent is None and seg.termination_reason == "paused"
    assert seg.remaining_step_budget == 5 and seg.remaining_token_budget > 0
    assert seg.behavior_logprobs == tuple(episode.turns[0].behavior_logprobs)
    assert set(seg.to_dict()) >= {"segment_id", "continuation_parent", "snapshot_id",
                                  "context_token_ids", "memory_state_ref",
                                  "behavior_policy_version", "behavior_logprobs",
                                  "sampler_config", "remaining_step_budget",
                                  "remaining_token_budget", "termination_reason"}


def test_resumed_under_another_version_the_episode_is_labelled_mixed(agent: dict[str, Any]
                                                                     ) -> None:
    torch.set_num_threads(1)
    old = collector(agent, "v0000")
    leases = [old.make_lease(f"g{i}", t, 11, 4) for i, t in enumerate(agent["tasks"])]
    store = SegmentStore()
    old.rollout_segment(leases, turn_budget=1, store=store)
    paused = store.take()
    assert paused
    new = collector(agent, "v0001")  # the same weights under another name: only labels move
    rest = new.resume(paused)
    for r in rest.values():
        assert r.mixed_policy
        assert [t.behavior_policy_version for t in r.turns] == \
            ["v0000"] + ["v0001"] * (len(r.turns) - 1)
        assert r.manifest.policy_version == "v0000"  # the lease's: the episode's first version
