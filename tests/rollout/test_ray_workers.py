"""Ray workers on a real local cluster (2 CPUs, a 100 MB object store, no dashboard), started
once for the test session (``tests/conftest.py``, ``ray_local``): the same seeds give the same
trajectories as the in-process collector, and a worker killed mid-episode ends its episodes
``infra_abort``, the group is discarded and counted, and the next collection runs."""

from __future__ import annotations

import pytest
import torch

from closedloop.contracts import SamplerConfig, Termination, sha256_hex
from closedloop.contracts.schema import encode_record
from closedloop.engine import HFGenerator
from closedloop.envs.terminal.package import terminal_package
from closedloop.envs.terminal.task_sets import list_tasks
from closedloop.errors import WorkerError
from closedloop.policy import ChatRenderer, build_tiny_model, load_embedded_tokenizer
from closedloop.policy.lora import attach_lora, policy_weight_checksum, split_state_dict
from closedloop.policy.weights import tensor_digests
from closedloop.rollout.admission import AdmissionController, apply_decision
from closedloop.rollout.collector import Collector, CollectorConfig
from closedloop.rollout.ledger import GroupSummary, Ledger
from closedloop.rollout.ray_workers import (
    HFPolicyBuilder,
    PolicySpec,
    RayCollection,
    RayWorkersConfig,
    remote_get,
)
from closedloop.rollout.source import GeneratorSource
from closedloop.rollout.verifier_step import VerifierStep
from closedloop.training.weight_sync import probe_of
from closedloop.training.wiring import build_manifest

T = 0.7
SALT = 7
# a Ray cluster and actors that import torch (~20 s)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, ray_local):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("ray")
    tok = load_embedded_tokenizer()
    base = build_tiny_model(tok, seed=0, init_std=0.3)
    base.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    policy = attach_lora(base, r=4, alpha=8, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    package = terminal_package()
    renderer = ChatRenderer(tok, package.system_prompt, [dict(t) for t in package.tool_schemas])
    checksum = policy_weight_checksum(policy).combined
    manifest = build_manifest(policy_version="v0000", weight_checksum=checksum,
                              tokenizer_revision=sha256_hex("tok"), renderer=renderer,
                              sampler=SamplerConfig(T), step_budget=3, max_action_tokens=12,
                              model_id="tiny")
    adapter = {k: v.detach().clone() for k, v in split_state_dict(policy)[1].items()}
    config = CollectorConfig(max_turns=3, sampling_salt=SALT)
    spec = PolicySpec(HFPolicyBuilder(str(root / "model"), lora_rank=4, lora_alpha=8), renderer,
                      renderer.action_text, package.family_split, "ray-run", config)
    ray = RayCollection(spec, package.make_env, RayWorkersConfig(
        env_workers=2, env_worker_cpus=0.25, generator_workers=1, generator_worker_cpus=1.0,
        queue_capacity=2, call_timeout_s=120))
    probe = probe_of(renderer, SamplerConfig(T))
    held = ray.load(adapter, checksum, probe)
    assert {w: c.combined for w, (c, _, _) in held.items()} == {"ray-generator-0": checksum}
    (_, digests, scored), = held.values()  # the worker's own digests, its own engine's probe
    assert digests == tensor_digests(adapter)
    assert scored == pytest.approx(HFGenerator(policy, tok).score(probe.ids, probe.sampler),
                                   abs=1e-4)
    local = Collector(GeneratorSource(HFGenerator(policy, tok, seed=0), renderer.action_text,
                                      SamplerConfig(T), 12, manifest.generator_build),
                      renderer, package.make_env, package.verifier(), package.family_split,
                      manifest, "ray-run", None, config)
    yield dict(ray=ray, local=local, manifest=manifest, root=root,
               verify=VerifierStep(package.verifier()))
    ray.shutdown()


def _leases(local, n, size, tag):
    tasks = list_tasks(split="train")
    return [local.make_lease(f"{tag}{i}", tasks[i], 11 + i, size) for i in range(n)]


def _comparable(episode):
    """An episode's records without what depends on the clock."""
    traj = encode_record(episode.trajectory)
    for key in ("timings", "rollout_started_at", "rollout_finished_at"):
        traj.pop(key, None)
    turns = [{k: v for k, v in encode_record(t).items() if k != "timings"}
             for t in episode.turns]
    return traj, turns


def test_same_seeds_give_the_in_process_trajectories(setup):
    leases = _leases(setup["local"], 3, 3, "same")
    local = setup["local"].collect(leases)
    remote = setup["verify"].score(setup["ray"].collect(setup["manifest"], leases))
    assert [g.lease for g in remote] == [g.lease for g in local]
    pairs = [(a, b) for ga, gb in zip(local, remote, strict=True)
             for a, b in zip(ga.episodes, gb.episodes, strict=True)]
    assert sum(len(a.turns) for a, _ in pairs) >= 9
    assert [_comparable(a) for a, _ in pairs] == [_comparable(b) for _, b in pairs]


def test_a_killed_environment_worker_aborts_its_episodes_and_the_run_goes_on(setup):
    ray, manifest = setup["ray"], setup["manifest"]
    pid = remote_get(ray.envs.actors[0].exit_after.remote(4), 30, "env-worker-0")
    (group,) = setup["verify"].score(ray.collect(manifest, _leases(setup["local"], 1, 4,
                                                                     "kill")))
    ends = [ep.trajectory.termination for ep in group.episodes]
    assert Termination.INFRA_ABORT in ends, ends  # the siblings placed on the dead worker
    assert all(ep.trajectory.reward is None for ep in group.episodes
               if ep.trajectory.termination == Termination.INFRA_ABORT)
    with pytest.raises(WorkerError, match="died"):
        remote_get(ray.envs.actors[0].ping.remote(), 30, "env-worker-0")
    ledger = Ledger(setup["root"] / "ledger.sqlite")
    try:
        trajs = [ep.trajectory for ep in group.episodes]
        ledger.record_collected(group.lease, GroupSummary.from_trajectories(trajs))
        apply_decision(ledger, AdmissionController(0).admit(trajs, group.lease, 0))
        counts = ledger.counts()
    finally:
        ledger.close()
    assert counts.discarded == 1 and counts.admitted == 0
    assert any("infra_abort" in reason or "censor" in reason for reason in counts.reasons)
    # the pool replaces the dead worker and the next collection completes
    (after,) = ray.collect(manifest, _leases(setup["local"], 1, 4, "after"))
    assert ray.envs.replaced == 1
    assert all(r.termination != Termination.INFRA_ABORT for r in after.rollouts)
    assert remote_get(ray.envs.actors[0].ping.remote(), 30, "env-worker-0") != pid
