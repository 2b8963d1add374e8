"""Publication that replicas prove: two generator replica processes (spawned; each rebuilds the
tiny agent from its folder) load every staged version into a shadow slot, hash what they
hold, serve the probe and acknowledge; the active version switches only once both did.

A corrupted byte, a publisher killed mid-write and a replica killed before a publication leave
the active version where it was and every replica serving it; a restarted replica serves the
active version; a replica left on stale weights is caught (``PublicationError``) and the
``weight_checksums`` gate fails on the run directory it leaves."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from closedloop.contracts import SamplerConfig, sha256_hex
from closedloop.errors import PublicationError
from closedloop.evaluate.gates.base import GateOptions
from closedloop.evaluate.gates.traces import gate_weight_checksums
from closedloop.evaluate.rundir import load_run
from closedloop.policy import attach_lora
from closedloop.policy.lora import PolicyChecksummer, split_state_dict
from closedloop.policy.registry import PolicyRegistry
from closedloop.training.publisher import ProbeReference, Publisher
from closedloop.training.replicas import PolicyRecipe, ReplicaPool
from closedloop.training.run import load_policy
from closedloop.training.weight_sync import probe_of
from closedloop.training.wiring import build_manifest

pytestmark = pytest.mark.slow  # replica processes: each imports torch and rebuilds the model

RL_LORA = (4, 8, ("q_proj", "v_proj"), 1)
ENV = {"id": None, "factory": None, "domain": "deterministic_terminal"}


class Trainer:
    """The trainer side of the test: the tiny agent with an RL adapter it changes at will."""

    def __init__(self, folder: Path) -> None:
        self.policy = load_policy(str(folder), "float32")
        r, alpha, targets, seed = RL_LORA
        self.model = attach_lora(self.policy.model, r=r, alpha=alpha, seed=seed,
                                 target_modules=targets)
        self.checksum = PolicyChecksummer(self.model)
        self.probe = probe_of(self.policy.renderer, SamplerConfig(1.0))

    def nudge(self, by: float) -> None:
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if "lora_B" in name:
                    p.add_(by)

    def manifest(self, version: str, checksum: Any) -> Any:
        loaded = self.policy.loaded
        return build_manifest(policy_version=version, weight_checksum=checksum.combined,
                              tokenizer_revision=sha256_hex("tiny"),
                              renderer=self.policy.renderer, sampler=SamplerConfig(1.0),
                              step_budget=6, max_action_tokens=64, model_id=loaded.model_id,
                              base_weight_checksum=checksum.base_checksum,
                              adapter_checksum=checksum.adapter_checksum)

    def adapter(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in split_state_dict(self.model)[1].items()}


def fleet(folder: Path, root: Path, trainer: Trainer, n: int,
          faults: dict[str, str] | None = None) -> tuple[Publisher, ReplicaPool]:
    recipe = PolicyRecipe(model=str(folder), dtype="float32", precision="float32",
                          sft_adapter=None, sft_lora=RL_LORA, rl_lora=RL_LORA,
                          environment=ENV, registry_root=str(root), run_id="pub-test",
                          probe=trainer.probe)
    pool = ReplicaPool(n, recipe, timeout_s=120.0, faults=faults)
    pool.start()
    registry = PolicyRegistry(root)
    publisher = Publisher(registry, [], trainer.manifest, probe=trainer.probe,
                          reference=ProbeReference(trainer.model, registry, "float32"),
                          probe_tol=1e-3, replicas=pool)
    return publisher, pool


def publish(publisher: Publisher, trainer: Trainer, version: str) -> None:
    publisher.stage(version, trainer.adapter(), trainer.checksum())


def serving(pool: ReplicaPool) -> set[tuple[str, str]]:
    return {(s["version"], s["checksum"]) for s in (r.status() for r in pool.replicas)}


def test_replicas_prove_each_version_and_refuse_what_they_cannot_prove(
        tiny_agent_dir: Path, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    trainer = Trainer(tiny_agent_dir)
    root = tmp_path / "registry"
    publisher, pool = fleet(tiny_agent_dir, root, trainer, 2)
    registry = publisher.registry
    try:
        publish(publisher, trainer, "v0000")
        trainer.nudge(0.05)
        publish(publisher, trainer, "v0001")
        v1 = registry.manifest("v0001")
        assert registry.active() is not None and registry.active().version == "v0001"
        assert serving(pool) == {("v0001", v1.weight_checksum)}
        acks = registry.require_all_worker_checksums("v0001", pool.worker_ids)
        assert all(a.probe_ids and a.probe_max_abs_delta is not None
                   and a.probe_max_abs_delta < 1e-3 and a.load_s > 0 for a in acks.values())

        # one byte of a staged version corrupted: no replica can prove it
        trainer.nudge(0.05)
        staged = registry.stage(trainer.adapter(), trainer.manifest("v0002", trainer.checksum()),
                                kind="adapter", version="v0002")
        blob = staged.path / "adapter.safetensors"
        data = bytearray(blob.read_bytes())
        data[-3] ^= 0x01
        blob.write_bytes(bytes(data))
        with pytest.raises(PublicationError, match="replica-0"):
            publisher.prove_replicas("v0002")
        assert registry.active().version == "v0001"
        assert serving(pool) == {("v0001", v1.weight_checksum)}

        # the publisher killed while it writes v0003: nothing partial is ever visible
        _kill_while_staging(root, trainer)
        assert "v0003" not in registry.versions() or registry.verify("v0003")
        assert registry.active().version == "v0001"
        assert serving(pool) == {("v0001", v1.weight_checksum)}

        # a replica killed before a publication: refused; restarted, it serves the active one
        publisher.quarantined.clear()
        pool.replicas[1].kill()
        with pytest.raises(PublicationError, match="replica-1"):
            publish(publisher, trainer, "v0004")
        assert registry.active().version == "v0001"
        pool.replicas[1].start()
        assert pool.replicas[1].started_version == "v0001"
        assert serving(pool) == {("v0001", v1.weight_checksum)}
        publisher.quarantined.clear()
        publisher.prove_replicas("v0004")
        assert registry.active().version == "v0004"
        assert serving(pool) == {("v0004", registry.manifest("v0004").weight_checksum)}
    finally:
        pool.stop()


def _kill_while_staging(root: Path, trainer: Trainer) -> None:
    """Stage v0003 (a large adapter, so the write takes a while) in a child and SIGKILL it."""
    script = textwrap.dedent(f"""
        import sys, torch
        from closedloop.contracts import SamplerConfig, sha256_hex
        from closedloop.policy.registry import PolicyRegistry
        from closedloop.contracts import PolicyManifest
        manifest = PolicyManifest.from_dict({trainer.manifest("v0003", trainer.checksum())
                                             .to_dict()!r})
        big = {{"base_model.model.x.lora_A.default.weight": torch.randn(4096, 4096)}}
        print("ready", flush=True)
        PolicyRegistry({str(root)!r}).stage(big, manifest, kind="adapter", version="v0003")
    """)
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                          text=True) as proc:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        try:
            proc.wait(timeout=0.3)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)


def test_a_replica_left_on_stale_weights_is_caught_and_fails_the_gate(
        tiny_agent_dir: Path, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    trainer = Trainer(tiny_agent_dir)
    run_dir = tmp_path / "run"
    (run_dir / "traces").mkdir(parents=True)
    publisher, pool = fleet(tiny_agent_dir, run_dir / "registry", trainer, 1,
                            faults={"replica-0": "stale"})
    try:
        publish(publisher, trainer, "v0000")  # its first version: nothing stale yet
        assert gate_weight_checksums(load_run(run_dir), GateOptions()).passed
        trainer.nudge(0.05)
        with pytest.raises(PublicationError, match="hashes its weights to"):
            publish(publisher, trainer, "v0001")
        assert publisher.registry.active().version == "v0000"
        assert "replica-0" in publisher.quarantined
    finally:
        pool.stop()
    gate = gate_weight_checksums(load_run(run_dir), GateOptions())
    assert gate.passed is False and "v0001/replica-0" in gate.evidence["ack_mismatches"]


@pytest.mark.parametrize("flags", [None, "fpu sse2 avx2 avx512f amx_tile amx_bf16"],
                         ids=["float32", "bf16"])
def test_a_run_publishes_every_version_through_its_replica(tiny_agent_dir: Path,
                                                           tmp_path: Path, monkeypatch,
                                                           flags: str | None) -> None:
    """A whole run (warm start included, which the replica merges as the run did) with one
    replica: every version proved by both workers, the gate passes, latencies are recorded.
    Float32 workers score the probe; bf16 ones prove by their hashes alone (docs/concepts.md,
    atomic weight publication)."""
    import json

    from closedloop.config import parse_config
    from closedloop.training.loop import train
    from tests.conftest import short_run_config

    data = short_run_config(tiny_agent_dir, 1)
    data["sft"] = {"enabled": True, "demonstrations": 2, "epochs": 1, "batch_size": 2}
    data["weight_sync"] = {"replicas": 1}
    if flags is not None:  # a host with native bf16: `auto` resolves to bfloat16
        monkeypatch.setenv("CLOSEDLOOP_CPU_FLAGS", flags)
    torch.set_num_threads(1)
    train(parse_config(data), tmp_path / "run")
    registry = PolicyRegistry(tmp_path / "run" / "registry")
    precision = json.loads((tmp_path / "run" / "config.json").read_text())["precision"]
    assert precision["precision"] == ("float32" if flags is None else "bfloat16")
    for version in registry.versions():
        acks = registry.require_all_worker_checksums(version, ["generator-0", "replica-0"])
        assert all(a.digests_hash for a in acks.values())
        assert all(bool(a.probe_ids) == (flags is None) for a in acks.values())
        assert all((a.probe_max_abs_delta is not None) == (flags is None)
                   for a in acks.values())
    assert registry.active() is not None and registry.active().version == "v0001"
    assert gate_weight_checksums(load_run(tmp_path / "run"), GateOptions()).passed
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines() if '"weight_sync"' in line]
    latency = records[0]["timing"]
    assert set(latency) == {"generator-0", "replica-0"}
    assert latency["replica-0"]["versions"] == 2 and latency["replica-0"]["load_p95_s"] > 0


def test_a_probe_served_from_other_weights_than_hashed_is_refused(tiny_agent_dir: Path,
                                                                  tmp_path: Path) -> None:
    """A worker that hashes v0001 (its checksum and digests are the staged ones) but whose
    engine serves v0000 is caught by the probe alone: its log-probs are v0000's, the trainer
    path's reference is v0001's. Log-probs of other ids than the probe's, or none, are
    refused; the probe's ids with v0001's log-probs are accepted."""
    from closedloop.training.weight_sync import Proof

    torch.set_num_threads(1)
    trainer = Trainer(tiny_agent_dir)
    registry = PolicyRegistry(tmp_path / "registry")
    publisher = Publisher(registry, ["w"], trainer.manifest, probe=trainer.probe,
                          reference=ProbeReference(trainer.model, registry, "float32"),
                          probe_tol=1e-3)
    publish(publisher, trainer, "v0000")
    trainer.nudge(0.05)
    publish(publisher, trainer, "v0001")
    scorer = ProbeReference(trainer.model, registry, "float32")
    served = {v: scorer.logprobs(v, trainer.probe) for v in ("v0000", "v0001")}
    assert len(served["v0001"]) == len(trainer.probe.ids) - 1
    assert max(abs(a - b) for a, b in zip(served["v0000"], served["v0001"], strict=True)) > 1e-3

    def proof(logprobs: list[float], ids: tuple[int, ...] = trainer.probe.ids) -> Proof:
        return Proof("w", "v0001", registry.manifest("v0001").weight_checksum,
                     registry.tensor_digests("v0001"), ids, tuple(logprobs), 0.1)

    with pytest.raises(PublicationError, match=r"probe log-probs are .* from the trainer's"):
        publisher.acknowledge(proof(served["v0000"]))
    assert registry.active() is None and "w" in publisher.quarantined
    publisher.quarantined.clear()
    # the right log-probs for other ids (a worker scoring a probe of its own choosing)
    with pytest.raises(PublicationError, match=r"scored another probe"):
        publisher.acknowledge(proof(served["v0001"], (*trainer.probe.ids[1:], 7)))
    publisher.quarantined.clear()
    # no probe at all: refused, unless it was proved where it was served (the vLLM replica)
    with pytest.raises(PublicationError, match=r"sent no probe log-probs"):
        publisher.acknowledge(proof([], ()))
    publisher.quarantined.clear()
    assert publisher.acknowledge(proof(served["v0001"]))
    assert registry.active() is not None and registry.active().version == "v0001"


def test_a_primed_reference_is_the_versions_without_reading_it_back(
        tiny_agent_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``prime`` scores the probe on the trainer's adapter before the version is staged; the
    proof of the version staged from those very weights is then checked against that score
    without reading the version back, and it is the score a reference loading the version
    from the registry computes. Another version's weights are still read from the registry."""
    torch.set_num_threads(1)
    trainer = Trainer(tiny_agent_dir)
    registry = PolicyRegistry(tmp_path / "registry")
    publisher = Publisher(registry, ["w"], trainer.manifest)
    publish(publisher, trainer, "v0000")
    trainer.nudge(0.05)
    primed = ProbeReference(trainer.model, registry, "float32")
    primed.prime(trainer.checksum().combined, trainer.adapter(), trainer.probe)
    publish(publisher, trainer, "v0001")
    fresh = ProbeReference(trainer.model, registry, "float32")
    loads: list[str] = []
    read = registry.load_state_dict

    def counted(version: str) -> dict[str, torch.Tensor]:
        loads.append(version)
        return read(version)

    monkeypatch.setattr(registry, "load_state_dict", counted)
    assert primed.logprobs("v0001", trainer.probe) == fresh.logprobs("v0001", trainer.probe)
    assert loads == ["v0001"]  # the fresh reference's read; the primed one read nothing
    v0 = primed.logprobs("v0000", trainer.probe)
    assert loads == ["v0001", "v0000"]
    assert v0 == fresh.logprobs("v0000", trainer.probe)
    assert v0 != primed.logprobs("v0001", trainer.probe)
