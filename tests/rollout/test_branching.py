"""Branching from a recorded decision state: the verified prefix restore, K forks that never
see each other's writes (key-and-door and the terminal tasks), a deterministic policy that
reproduces one return K times, the branch records, the branch-point rules and the credit."""

from __future__ import annotations

import dataclasses

import pytest

from closedloop.contracts import SamplerConfig, TraceWriter, load_episodes, sha256_hex
from closedloop.envs.discovery import resolve_package
from closedloop.errors import BranchError, PrefixRestoreError
from closedloop.learn.branching import branch_compute, branch_credit
from closedloop.learn.recurrent_ac import FeatureRenderer, FeatureSource
from closedloop.policy import weights_checksum
from closedloop.rollout.branching import BranchCollector, branch_points
from closedloop.rollout.prefix import boundary_states, restore_prefix
from closedloop.rollout.replay import replay_episode
from closedloop.rollout.source import ScriptedSource
from closedloop.training.wiring import build_manifest
from tests.learn.keydoor_traces import collect_keydoor, feature_policy, keydoor, keydoor_tasks


def _branch_collector(model, greedy, writer=None, salt=7):
    pkg = keydoor()
    renderer = FeatureRenderer(pkg)
    sampler = SamplerConfig(greedy=greedy)
    manifest = build_manifest(policy_version="v0000", weight_checksum=weights_checksum(model),
                              tokenizer_revision=sha256_hex("features"), renderer=renderer,
                              sampler=sampler, step_budget=12, max_action_tokens=1,
                              model_id="gru")
    from closedloop.rollout.collector import CollectorConfig
    return BranchCollector(FeatureSource(model, pkg.feature_codec, sampler), renderer,
                           pkg.make_env, pkg.verifier(), pkg.family_split, manifest,
                           "keydoor-test", writer, CollectorConfig(12, sampling_salt=salt))


def _long_parent(model, greedy=False):
    train, _ = keydoor_tasks(4, 2)
    eps = collect_keydoor(model, train, group_size=6, greedy=greedy)
    return max(eps, key=lambda e: len(e.turns))


def test_k_forks_from_one_snapshot_never_see_each_others_writes(tmp_path) -> None:
    model = feature_policy(seed=1)
    parent = _long_parent(model)
    assert len(parent.turns) >= 3
    env = keydoor().make_env()
    prefix = restore_prefix(parent, 1, env)
    s_t = prefix.snapshot
    trace = tmp_path / "branches.jsonl"
    with TraceWriter(trace) as writer:
        (group,) = _branch_collector(model, greedy=False, writer=writer).collect_branches(
            [(prefix, env)], k=6)
    assert env.state_hash() == s_t.state_hash  # the env holding S_t was never written to
    finals = set()
    for ep in group.episodes:
        own = ep.turns[prefix.turn]
        assert own.state_before == s_t.state_hash  # each branch starts at S_t exactly
        # each branch alone reproduces every state it recorded: no sibling's write leaked in
        assert replay_episode(ep, keydoor().make_env(), keydoor().verifier()).ok
        finals.add(ep.trajectory.final_state_hash)
    assert len(finals) > 1  # the branches did write, and differently
    # the records: parent, branch point and snapshot manifest; the copied prefix is masked
    _, loaded = load_episodes(trace)
    assert sorted(e.trajectory.episode_id for e in loaded) == [e.trajectory.episode_id
                                                               for e in group.episodes]
    for ep in loaded:
        tr = ep.trajectory
        assert (tr.parent_run_id, tr.parent_episode_id, tr.branch_point_turn) == (
            "keydoor-test", parent.trajectory.episode_id, 1)
        assert tr.branch_point is not None
        assert tr.branch_point["snapshot"]["snapshot_id"] == s_t.snapshot_id
        assert tr.branch_point["context_hash"] == prefix.context_hash
        assert tr.base_snapshot_id == parent.trajectory.base_snapshot_id
        assert ep.turns[0].action_mask == [0] and ep.turns[0].continuation_parent is not None
        assert all(t.action_mask == [1] for t in ep.turns[1:])
        assert ep.context_token_ids(1) == list(prefix.context_ids)
    cost = branch_compute([group.episodes])
    assert (cost.sets, cost.continuations) == (1, 6)
    assert cost.turns == sum(len(e.turns) - 1 for e in group.episodes) == cost.action_tokens


def test_a_deterministic_policy_reproduces_one_return_k_times() -> None:
    model = feature_policy(seed=2)
    parent = _long_parent(model, greedy=True)
    env = keydoor().make_env()
    t = len(parent.turns) - 1
    prefix = restore_prefix(parent, t, env)
    (group,) = _branch_collector(model, greedy=True).collect_branches([(prefix, env)], k=4)
    texts = {tuple(x.action_text for x in ep.turns) for ep in group.episodes}
    assert texts == {tuple(x.action_text for x in parent.turns)}  # the parent's own future
    returns = {ep.trajectory.task_success for ep in group.episodes}
    assert returns == {parent.trajectory.task_success}
    credit = branch_credit(group.episodes)
    assert credit.zero_variance and credit.advantages is not None
    assert credit.advantages.abs().max() == 0


def test_terminal_forks_are_isolated_under_file_writes() -> None:
    pkg = resolve_package("terminal-repair-v1")
    from closedloop.contracts.package import TaskSetRequest
    from closedloop.policy import load_embedded_tokenizer
    from closedloop.rollout.collector import CollectorConfig
    from closedloop.training.wiring import make_renderer

    task = pkg.task_sets(TaskSetRequest(2, 1)).train[0]
    renderer = make_renderer(load_embedded_tokenizer(), pkg)
    manifest = build_manifest(policy_version="v0000", weight_checksum=sha256_hex("s"),
                              tokenizer_revision=sha256_hex("t"), renderer=renderer,
                              sampler=SamplerConfig(), step_budget=8, max_action_tokens=64,
                              model_id="scripted")

    def policy(task_id, key):
        seed = int(key.rsplit("/", 1)[1]) + 3 * ("@" in key)
        return pkg.scripted_policy("noisy", task_id, seed, 0.6)

    collector = BranchCollector(ScriptedSource(policy, renderer.encode), renderer,
                                pkg.make_env, pkg.verifier(), pkg.family_split, manifest,
                                "terminal-test", None, CollectorConfig(8))
    (parent_group,) = collector.collect([collector.make_lease("p", task, 11, 1)])
    parent = parent_group.episodes[0]
    assert len(parent.turns) >= 2
    env = pkg.make_env()
    prefix = restore_prefix(parent, 1, env)
    (group,) = collector.collect_branches([(prefix, env)], k=4)
    for ep in group.episodes:
        assert ep.turns[1].state_before == prefix.snapshot.state_hash
        assert replay_episode(ep, pkg.make_env(), pkg.verifier()).ok
    assert env.state_hash() == prefix.snapshot.state_hash


def test_a_prefix_that_does_not_replay_is_refused() -> None:
    model = feature_policy(seed=1)
    parent = _long_parent(model)
    turns = list(parent.turns)
    turns[0] = dataclasses.replace(turns[0], state_after=sha256_hex("tampered"))
    forged = dataclasses.replace(parent, turns=tuple(turns))
    with pytest.raises(PrefixRestoreError):
        restore_prefix(forged, 1, keydoor().make_env())
    with pytest.raises(PrefixRestoreError):
        boundary_states(forged, keydoor().make_env())
    with pytest.raises(BranchError):
        restore_prefix(parent, 0, keydoor().make_env())  # t = 0 is the group itself
    with pytest.raises(BranchError):
        restore_prefix(parent, len(parent.turns), keydoor().make_env())


def test_branch_point_rules() -> None:
    model = feature_policy(seed=4)
    train, _ = keydoor_tasks(4, 2)
    for ep in collect_keydoor(model, train, group_size=4):
        after = branch_points(ep, "after_tool_observation")
        if after:
            prev = ep.turns[after[0] - 1]
            assert prev.action_kind == "tool" and prev.observation_error is None
            assert all(not (p.action_kind == "tool" and p.observation_error is None)
                       for p in ep.turns[: after[0] - 1])
        surprise = branch_points(ep, "max_surprisal")
        assert surprise == ([] if len(ep.turns) < 2 else [max(
            range(1, len(ep.turns)), key=lambda t: (-ep.turns[t].behavior_logprobs[0], t))])
    with pytest.raises(BranchError):
        branch_points(ep, "random")  # type: ignore[arg-type]
