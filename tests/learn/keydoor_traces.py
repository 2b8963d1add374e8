"""Recorded key-and-door episodes for the credit tests: the recurrent feature policy (random
weights, or given) sampled through the real collector, renderer, verifier and manifest."""

from __future__ import annotations

from collections.abc import Sequence

from closedloop.contracts import Action, Episode, SamplerConfig, TraceWriter, sha256_hex
from closedloop.contracts.package import EnvPackage, TaskSetRequest
from closedloop.envs.discovery import resolve_package
from closedloop.learn.recurrent_ac import FeatureRenderer, FeatureSource, RecurrentActorCritic
from closedloop.policy import weights_checksum
from closedloop.training.wiring import CollectorParts, build_manifest, make_collector


def keydoor() -> EnvPackage:
    return resolve_package("keydoor-v1")


def feature_policy(seed: int = 0) -> RecurrentActorCritic:
    codec = keydoor().feature_codec
    assert codec is not None
    return RecurrentActorCritic(codec.n_features, len(codec.actions), hidden=32, seed=seed)


def collect_keydoor(model: RecurrentActorCritic, task_ids: Sequence[str], *, group_size: int,
                    max_turns: int = 12, salt: int = 0, greedy: bool = False,
                    writer: TraceWriter | None = None) -> list[Episode]:
    """``group_size`` episodes of each task, sampled by ``model`` through the collector."""
    pkg = keydoor()
    assert pkg.feature_codec is not None
    renderer = FeatureRenderer(pkg)
    sampler = SamplerConfig(greedy=greedy)
    manifest = build_manifest(policy_version="v0000", weight_checksum=weights_checksum(model),
                              tokenizer_revision=sha256_hex("features"), renderer=renderer,
                              sampler=sampler, step_budget=max_turns, max_action_tokens=1,
                              model_id="gru")
    source = FeatureSource(model, pkg.feature_codec, sampler)
    collector = make_collector(source, manifest, CollectorParts(
        renderer, pkg.verifier(), "keydoor-test", writer, max_turns, pkg, sampling_salt=salt))
    leases = [collector.make_lease(f"g{i}", t, 1, group_size) for i, t in enumerate(task_ids)]
    return [ep for g in collector.collect(leases) for ep in g.episodes]


def keydoor_tasks(train: int = 8, heldout: int = 4) -> tuple[tuple[str, ...], tuple[str, ...]]:
    sets = keydoor().task_sets(TaskSetRequest(train, heldout))
    return sets.train, sets.heldout


class DetourExpert:
    """Plays key-and-door from observations, with seeded detours: a second ``inspect``, the
    wrong key first, or (holding the wrong key) the wrong door. Its actions' effects on the
    return are known from the rules: detours cost time (fatal on ``tight`` tasks), the right
    key and door are necessary, the wrong door is fatal."""

    def __init__(self, seed: str, detour: float = 0.3) -> None:
        import random

        self.rng = random.Random(seed)
        self.detour = detour
        self.target: str | None = None
        self.plan: list[str] | None = None

    def act(self, observation: str) -> Action:

        codec = keydoor().feature_codec
        assert codec is not None
        f = codec.features(observation)
        if f[1] or f[2]:
            self.target = "red" if f[1] else "blue"
        if self.plan is None:
            self.plan = ["inspect"] + (["inspect"] if self.rng.random() < self.detour else [])
        if self.plan:
            return Action.tool(self.plan.pop(0))
        if f[5]:
            return Action.finish()
        held = "red" if f[3] else "blue" if f[4] else None
        other = "blue" if self.target == "red" else "red"
        if held == self.target:
            return Action.tool(f"open_{self.target}")
        if held is None and self.rng.random() < self.detour:
            return Action.tool(f"pickup_{other}")
        if held == other and self.rng.random() < self.detour / 2:
            return Action.tool(f"open_{other}")
        return Action.tool(f"pickup_{self.target}")


def collect_detours(task_ids: Sequence[str], group_size: int) -> list[Episode]:
    """``group_size`` episodes of the detour expert per task, in the feature scaffold."""
    from closedloop.rollout.source import ScriptedSource

    pkg = keydoor()
    renderer = FeatureRenderer(pkg)
    manifest = build_manifest(policy_version="detour", weight_checksum=sha256_hex("detour"),
                              tokenizer_revision=sha256_hex("features"), renderer=renderer,
                              sampler=SamplerConfig(), step_budget=12, max_action_tokens=1,
                              model_id="detour-expert")
    source = ScriptedSource(lambda task, key: DetourExpert(key), renderer.encode)
    collector = make_collector(source, manifest, CollectorParts(
        renderer, pkg.verifier(), "detour", None, 12, pkg))
    leases = [collector.make_lease(f"d{i}", t, 1, group_size) for i, t in enumerate(task_ids)]
    return [ep for g in collector.collect(leases) for ep in g.episodes]
