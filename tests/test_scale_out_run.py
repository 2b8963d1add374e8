"""A training run on Ray workers (``rollout.workers: ray``) on the session's local cluster: an
environment worker killed mid-episode in the first RL step ends its episodes ``infra_abort``,
the groups are discarded and counted in the ledger, and the run trains on to its summary with
every version acknowledged by the generator workers that hashed it and scored its probe."""

from __future__ import annotations

import pytest

from closedloop.config import parse_config
from closedloop.evaluate.gates.base import GateOptions
from closedloop.evaluate.gates.traces import gate_weight_checksums
from closedloop.evaluate.rundir import load_run
from closedloop.policy.registry import PolicyRegistry
from closedloop.rollout.ledger import Ledger
from closedloop.rollout.ray_workers import RayCollection, remote_get
from closedloop.training.loop import train
from tests.conftest import short_run_config

# a short tiny-agent run on Ray actors (~1-2 min)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]


def test_a_run_on_ray_workers_survives_a_killed_environment_worker(tiny_agent_dir, ray_local,
                                                                   tmp_path, monkeypatch):
    data = short_run_config(tiny_agent_dir, rl_steps=2)
    data["rollout"]["workers"] = "ray"
    data["credit"]["censor_rule"] = "discard_group"
    data["ray"] = {"env_workers": 2, "env_worker_cpus": 0.25, "generator_workers": 1,
                   "generator_worker_cpus": 1.0, "call_timeout_s": 120}
    cfg = parse_config(data)
    real_collect = RayCollection.collect
    kills: list[int] = []

    def collect_with_a_death(self, manifest, leases):
        if not kills:  # the first RL step: worker 0 dies at its 5th environment call
            kills.append(remote_get(self.envs.actors[0].exit_after.remote(5), 30, "env-0"))
        return real_collect(self, manifest, leases)

    monkeypatch.setattr(RayCollection, "collect", collect_with_a_death)
    summary = train(cfg, tmp_path / "run", final_retain=False)
    assert kills and summary["rl_steps_this_session"] == 2
    ledger = Ledger(tmp_path / "run" / "ledger.sqlite")
    try:
        counts = ledger.counts()
    finally:
        ledger.close()
    assert counts.discarded >= 1, counts
    assert counts.discarded + counts.consumed == 4
    run = load_run(tmp_path / "run")
    aborted = [t for t in run.traces["step-0000"].raw("trajectory")
               if t["termination"] == "infra_abort"]
    assert aborted and all(t["reward"] is None for t in aborted)
    acks = sorted(p.name for p in (tmp_path / "run" / "registry" / "acks" / "v0001").iterdir())
    assert acks == ["generator-0.json", "ray-generator-0.json"]
    # the Ray worker scored the fixed probe on its own engine, checked against the trainer path
    proofs = PolicyRegistry(tmp_path / "run" / "registry").require_all_worker_checksums(
        "v0001", ["generator-0", "ray-generator-0"])
    assert proofs["ray-generator-0"].probe_ids == proofs["generator-0"].probe_ids
    assert 0 <= proofs["ray-generator-0"].probe_max_abs_delta <= cfg.consistency.max_abs_tolerance
    gate = gate_weight_checksums(run, GateOptions())
    assert gate.passed is True, gate.detail
