"""The collector on the real environment and verifier: leases, threading, censoring."""

import pytest

from closedloop.contracts import (
    Action,
    SamplerConfig,
    Termination,
    TraceWriter,
    load_episodes,
)
from closedloop.engine import HFGenerator
from closedloop.envs.terminal.families.registry import get_bundle
from closedloop.envs.terminal.package import AGENT_TOOLS, SYSTEM_PROMPT
from closedloop.envs.terminal.task_sets import list_tasks
from closedloop.envs.terminal.verifier import Verifier
from closedloop.policy import ChatRenderer, build_tiny_model, load_embedded_tokenizer
from closedloop.policy.weights import weights_checksum
from closedloop.rollout.source import GeneratorSource, ScriptedSource
from closedloop.training.wiring import CollectorParts, build_manifest, make_collector


class GoldPolicy:
    """Plays a task's gold actions in order (the expert's core, without recovery)."""

    def __init__(self, task_id):
        self.actions = list(get_bundle(task_id).grader.gold_actions)

    def act(self, observation):
        return self.actions.pop(0) if self.actions else Action.finish()


@pytest.fixture(scope="module")
def tokenizer():
    return load_embedded_tokenizer()


@pytest.fixture(scope="module")
def renderer(tokenizer):
    return ChatRenderer(tokenizer, SYSTEM_PROMPT, list(AGENT_TOOLS))


def manifest_for(renderer, checksum, max_action_tokens=48, sampler=None):
    from closedloop.contracts import sha256_hex
    return build_manifest(policy_version="v0000", weight_checksum=checksum,
                          tokenizer_revision=sha256_hex("tok"), renderer=renderer,
                          sampler=sampler or SamplerConfig(), step_budget=8,
                          max_action_tokens=max_action_tokens, model_id="test")


def test_scripted_gold_groups_succeed_and_thread(tmp_path, renderer):
    from closedloop.contracts import sha256_hex
    manifest = manifest_for(renderer, sha256_hex("scripted"))
    source = ScriptedSource(lambda task_id, key: GoldPolicy(task_id), renderer.encode)
    trace = tmp_path / "trace.jsonl"
    tasks = [t for t in list_tasks(split="heldout")][::4][:4]
    with TraceWriter(trace) as writer:
        parts = CollectorParts(renderer, Verifier(), "run-test", writer, max_turns=8)
        collector = make_collector(source, manifest, parts)
        leases = [collector.make_lease(f"g{i}", t, 11, 2) for i, t in enumerate(tasks)]
        groups = collector.collect(leases)
    assert [len(g.episodes) for g in groups] == [2] * len(tasks)
    for group in groups:
        for ep in group.episodes:
            traj = ep.trajectory
            assert traj.termination == Termination.AGENT_FINISH
            assert traj.reward is not None and traj.reward["task_success"] == 1.0
            assert traj.base_snapshot_id == group.lease.base_snapshot_id
    # the trace alone rebuilds every episode, and the threading is exact
    leases, episodes = load_episodes(trace)
    assert len(leases) == len(tasks) and len(episodes) == 2 * len(tasks)
    for ep in episodes:
        context = list(ep.turns[0].prompt_token_ids)
        for t in ep.turns:
            assert ep.context_token_ids(t.turn) == context
            context += t.action_token_ids
            context += renderer.render_observation(t.observation,
                                                   turn_closed=renderer.turn_closed(
                                                       t.action_token_ids))


def test_tiny_model_episodes_are_censored_not_zero(tmp_path, tokenizer, renderer):
    model = build_tiny_model(tokenizer, seed=0)
    checksum = weights_checksum(model)
    sampler = SamplerConfig(temperature=0.7, top_p=0.9)
    manifest = manifest_for(renderer, checksum, max_action_tokens=6, sampler=sampler)
    gen = HFGenerator(model, tokenizer, weight_checksum=checksum, seed=0)
    source = GeneratorSource(gen, renderer.action_text, sampler, 6, "hf-test")
    trace = tmp_path / "trace.jsonl"
    task = list_tasks(split="train")[0]
    with TraceWriter(trace) as writer:
        collector = make_collector(source, manifest,
                                   CollectorParts(renderer, Verifier(), "run-t", writer, 8))
        leases = [collector.make_lease("g0", task, 11, 3), collector.make_lease("g1", task, 22, 2)]
        groups = collector.collect(leases)
    episodes = [ep for g in groups for ep in g.episodes]
    assert len(episodes) == 5
    for ep in episodes:
        traj = ep.trajectory
        # a random tiny model never closes a call within 6 tokens: censored, never scored 0
        assert traj.termination == Termination.MAX_TOKEN_TRUNCATION
        assert traj.reward is None
        assert traj.behavior_policy_version == "v0000"
        for t in ep.turns:
            assert len(t.behavior_logprobs) == len(t.action_token_ids)
            assert t.raw_model_logprobs is not None
            assert t.sampler_config == sampler
    # siblings share task, seed, base snapshot, manifest and sampler
    for g in groups:
        keys = {(e.trajectory.task_id, e.trajectory.seed, e.trajectory.base_snapshot_id,
                 e.trajectory.policy_manifest_hash, e.trajectory.sampler_config)
                for e in g.episodes}
        assert len(keys) == 1
    load_episodes(trace)


def test_sampling_streams_pair_episodes_by_task_seed_and_sibling(tokenizer, renderer):
    """With a sampling salt, an episode's tokens depend on (salt, task, seed, sibling) only:
    not on its group id, its batch companions or the generator's own rng."""
    model = build_tiny_model(tokenizer, seed=0)
    checksum = weights_checksum(model)
    sampler = SamplerConfig(temperature=0.7)
    manifest = manifest_for(renderer, checksum, max_action_tokens=5, sampler=sampler)
    task, other = list_tasks(split="train")[:2]

    def actions(salt, leases, gen_seed=0):
        gen = HFGenerator(model, tokenizer, weight_checksum=checksum, seed=gen_seed)
        source = GeneratorSource(gen, renderer.action_text, sampler, 5, "hf-test")
        collector = make_collector(source, manifest, CollectorParts(
            renderer, Verifier(), "run-t", None, 2, sampling_salt=salt))
        groups = collector.collect([collector.make_lease(*lease) for lease in leases])
        return {(g.lease.task_id, g.lease.seed, ep.trajectory.sample_index):
                [t.action_token_ids for t in ep.turns] for g in groups for ep in g.episodes}

    first = actions(0, [("eval-start-0", task, 11, 2)])
    again = actions(0, [("eval-final-0", task, 11, 2), ("x", other, 22, 3)], gen_seed=9)
    assert all(again[k] == v for k, v in first.items())
    assert first[(task, 11, 0)] != first[(task, 11, 1)]  # siblings draw their own streams
    salted = actions(1, [("eval-start-0", task, 11, 2)])
    assert salted[(task, 11, 0)] != first[(task, 11, 0)]  # another run's salt samples anew


def test_context_window_overflow_is_censored_not_cut(tokenizer, renderer):
    model = build_tiny_model(tokenizer, seed=0)
    checksum = weights_checksum(model)
    sampler = SamplerConfig()
    manifest = manifest_for(renderer, checksum, max_action_tokens=4, sampler=sampler)
    # the rendered prompt alone (~500 tokens) does not fit a 100-token window
    gen = HFGenerator(model, tokenizer, weight_checksum=checksum, seed=0, max_context=100)
    source = GeneratorSource(gen, renderer.action_text, sampler, 4, "hf-test")
    collector = make_collector(source, manifest,
                               CollectorParts(renderer, Verifier(), "run-c", None, 8))
    task = list_tasks(split="train")[0]
    (group,) = collector.collect([collector.make_lease("g0", task, 11, 2)])
    for ep in group.episodes:
        assert ep.trajectory.termination == Termination.MAX_TOKEN_TRUNCATION
        assert ep.trajectory.reward is None
        assert ep.turns == ()  # ended before any action: never generated from a cut context


class Scripted:
    """Plays a fixed list of actions, then ``finish``."""

    def __init__(self, actions):
        self.actions = list(actions)

    def act(self, observation):
        return self.actions.pop(0) if self.actions else Action.finish()


def _command_task():
    from closedloop.envs.terminal.families.registry import get_spec
    for task in list_tasks(split="train"):
        spec = get_spec(task)
        if spec.commands and "run" in spec.allowed_tools:
            return task, sorted(spec.commands)[0]
    raise AssertionError("no train task allows run")


def _collect_one(renderer, policy, task, writer=None):
    from closedloop.contracts import sha256_hex
    source = ScriptedSource(lambda task_id, key: policy, renderer.encode)
    collector = make_collector(source, manifest_for(renderer, sha256_hex("scripted")),
                               CollectorParts(renderer, Verifier(), "run-infra", writer, 8))
    (group,) = collector.collect([collector.make_lease("g0", task, 11, 1)])
    return group.episodes[0]


def test_sandbox_infrastructure_failure_is_infra_abort_unscored(renderer, monkeypatch):
    import closedloop.envs.terminal.sandbox as sandbox_module

    task, command = _command_task()

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(sandbox_module.tempfile, "mkdtemp", broken)
    ep = _collect_one(renderer, Scripted([Action.tool("run", command=command)]), task)
    assert ep.trajectory.termination == Termination.INFRA_ABORT
    assert ep.trajectory.reward is None
    assert ep.turns[-1].observation_error.startswith("infra_abort: SandboxInfraError")


def test_programming_errors_propagate_instead_of_becoming_infra_abort(tmp_path, renderer,
                                                                      monkeypatch):
    from closedloop.envs.terminal import TerminalRepairEnv

    task, _ = _command_task()

    class Broken:
        def act(self, observation):
            raise TypeError("generator bug")

    trace = tmp_path / "trace.partial"
    with pytest.raises(TypeError, match="generator bug"), TraceWriter(trace) as writer:
        _collect_one(renderer, Broken(), task, writer)

    def broken_step(self, action):
        raise TypeError("env bug")

    monkeypatch.setattr(TerminalRepairEnv, "step", broken_step)
    with pytest.raises(TypeError, match="env bug"):
        _collect_one(renderer, Scripted([Action.tool("list_dir")]), task)


def test_malformed_and_surrogate_text_is_an_observation_not_an_error(tmp_path, renderer):
    task, _ = _command_task()
    texts = ["<tool_call>{not json", '<tool_call>{"name": "write_file", "arguments": '
             '{"path": "a\\udbff.txt", "content": "x"}}</tool_call>']
    trace = tmp_path / "trace.jsonl"
    with TraceWriter(trace) as writer:
        ep = _collect_one(renderer, Scripted(texts), task, writer)
    assert [t.observation_error for t in ep.turns] == ["invalid_action", "bad_arguments", None]
    assert ep.trajectory.termination == Termination.AGENT_FINISH
    _, (back,) = load_episodes(trace)
    assert back.turns[1].tool_args == {"path": "a\udbff.txt", "content": "x"}


class _VerifierBug(Verifier):
    def score_detailed(self, task_id, final_state):
        raise TypeError("grader bug")


class _VerifierTimeout(Verifier):
    def score_detailed(self, task_id, final_state):
        from closedloop.errors import VerifierFailure
        raise VerifierFailure("grader ran past its 5 s")


def _collect_scored_by(renderer, verifier):
    from closedloop.contracts import guarded, sha256_hex
    task = list_tasks(split="train")[0]
    source = ScriptedSource(lambda task_id, key: GoldPolicy(task_id), renderer.encode)
    collector = make_collector(source, manifest_for(renderer, sha256_hex("scripted")),
                               CollectorParts(renderer, guarded(verifier), "run-v", None, 8))
    (group,) = collector.collect([collector.make_lease("g0", task, 11, 1)])
    return group.episodes[0]


def test_a_verifier_programming_error_stops_collection_and_a_declared_failure_is_unscored(
        renderer):
    with pytest.raises(TypeError, match="grader bug") as info:
        _collect_scored_by(renderer, _VerifierBug())
    assert any("programming error" in note for note in info.value.__notes__)
    ep = _collect_scored_by(renderer, _VerifierTimeout())
    assert ep.trajectory.reward is None
    assert ep.trajectory.quarantine_reason.startswith("verifier_failure: VerifierFailure")


def test_an_episode_past_its_deadline_is_cancelled_not_scored(renderer):
    from closedloop.contracts import sha256_hex
    from closedloop.rollout.collector import Collector, CollectorConfig

    task = list_tasks(split="train")[0]

    class Slow:
        def act(self, observation):
            import time
            time.sleep(0.05)
            return Action.tool("list_dir", path=".")

    source = ScriptedSource(lambda task_id, key: Slow(), renderer.encode)
    base = make_collector(source, manifest_for(renderer, sha256_hex("scripted")),
                          CollectorParts(renderer, Verifier(), "run-d", None, 8,
                                         episode_deadline_s=0.12))
    assert isinstance(base, Collector) and base.config.episode_deadline_s == 0.12
    (group,) = base.collect([base.make_lease("g0", task, 11, 2)])
    for ep in group.episodes:
        assert ep.trajectory.termination == Termination.SCHEDULER_CANCEL
        assert ep.trajectory.reward is None and 1 <= len(ep.turns) < 8
    assert CollectorConfig().episode_deadline_s is None  # no deadline unless configured
