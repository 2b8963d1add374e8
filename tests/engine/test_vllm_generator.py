"""The vLLM generator against a real vLLM CPU engine (``.vllm-venv``, ``scripts/setup-vllm``).

One engine serves the whole module (starting it takes 40-150 s on two shared cores, ~3 GB): a
tiny random Llama with head_dim 32 (the CPU attention kernels support 32, 64, 80, ...; the
suite's usual head_dim 16 crashes vLLM's first request) under a LoRA adapter published through
the policy registry. Without the vLLM environment these tests skip with the exact reason.

What must hold: the behaviour log-probs the engine records are the trainer's tempered log-probs
at the same version (the audit passes); a replica whose engine keeps serving the previous
adapter is not acknowledged and the weight gate fails the run; behaviour log-probs taken before
the temperature (vLLM's default raw mode) fail the ratio gate.
"""

from __future__ import annotations

import json
import math
import stat
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from closedloop.contracts import Episode, SamplerConfig, TraceWriter, sha256_hex
from closedloop.engine.vllm_engine import (
    EngineConfig,
    VLLMEngine,
    vllm_unavailable_reason,
)
from closedloop.engine.vllm_generator import VLLMGenerator, action_seed
from closedloop.engine.vllm_replica import (
    LoraLayout,
    Probe,
    VLLMReplica,
    publish_proven,
    trainer_probe_reference,
)
from closedloop.engine.vllm_server import hash_tensors
from closedloop.envs.terminal.package import AGENT_TOOLS, SYSTEM_PROMPT
from closedloop.envs.terminal.task_sets import list_tasks
from closedloop.envs.terminal.verifier import Verifier
from closedloop.errors import (
    EngineTimeoutError,
    EngineUnavailableError,
    GenerationError,
    MissingAckError,
    ReplicaProofError,
)
from closedloop.evaluate.gates.base import GateOptions
from closedloop.evaluate.gates.signal import gate_ratio_on_policy
from closedloop.evaluate.gates.traces import gate_weight_checksums
from closedloop.evaluate.rundir import RunDir, load_run
from closedloop.learn.logprob_audit import audit_logprobs
from closedloop.learn.trainer import Trainer, TrainerConfig
from closedloop.policy import ChatRenderer, build_tiny_model, load_embedded_tokenizer
from closedloop.policy.lora import attach_lora, policy_weight_checksum, split_state_dict
from closedloop.policy.registry import PolicyRegistry
from closedloop.policy.weights import checksum_and_digests, checksum_tensors
from closedloop.rollout.source import GeneratorSource
from closedloop.rollout.tensors import build_training_batch
from closedloop.training.wiring import CollectorParts, build_manifest, make_collector

T = 0.7
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
LAYOUT = LoraLayout(r=4, alpha=8, target_modules=TARGETS)
WORKER = "vllm-0"
REASON = vllm_unavailable_reason()
needs_vllm = pytest.mark.skipif(REASON is not None, reason=REASON or "")
pytestmark = pytest.mark.xdist_group("vllm")  # the module's one engine serves every test


def test_the_engine_hashes_with_closedloops_recipe():
    gen = torch.Generator().manual_seed(0)
    state = {"b.weight": torch.randn(3, 4, generator=gen),
             "a.lora_A.default.weight": torch.randn(2, 5, generator=gen).to(torch.bfloat16),
             "c": torch.arange(7)}
    checksum, digests = hash_tensors(state.items())
    assert checksum == checksum_tensors(state.items())
    assert (checksum, digests) == checksum_and_digests(state)  # the same one-walk recipe
    assert set(digests) == set(state)
    one = dict(state, c=torch.arange(7) + 1)
    _, other = hash_tensors(one.items())
    assert [n for n in state if digests[n] != other[n]] == ["c"]


def test_a_missing_environment_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("CLOSEDLOOP_VLLM_PYTHON", str(tmp_path / "nowhere" / "bin" / "python"))
    reason = vllm_unavailable_reason()
    assert reason is not None and "no vLLM environment" in reason
    with pytest.raises(EngineUnavailableError, match="no vLLM environment"):
        VLLMEngine(EngineConfig(model=str(tmp_path)))


def test_an_engine_that_never_answers_is_killed_not_waited_on(tmp_path):
    silent = tmp_path / "python"
    silent.write_text("#!/bin/sh\nexec sleep 300\n")
    silent.chmod(silent.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(EngineTimeoutError, match="no answer to start within 1 s"):
        VLLMEngine(EngineConfig(model=str(tmp_path), startup_timeout_s=1.0), python=silent)


def _perturb_adapter(model, seed: int) -> None:
    """Give the LoRA B matrices non-zero values (a fresh adapter equals the base)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def _stage(registry, model, renderer, version):
    ident = policy_weight_checksum(model)
    template = build_manifest(policy_version=version, weight_checksum=ident.combined,
                              tokenizer_revision=sha256_hex("tok"), renderer=renderer,
                              sampler=SamplerConfig(temperature=T), step_budget=3,
                              max_action_tokens=12, model_id="tiny-vllm",
                              base_weight_checksum=ident.base_checksum,
                              adapter_checksum=ident.adapter_checksum)
    adapter = {k: v.detach().clone() for k, v in split_state_dict(model)[1].items()}
    return registry.stage(adapter, template, kind="adapter", version=version).manifest


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """One engine (module doc), the policy it serves, a run directory with a registry."""
    if REASON is not None:
        pytest.skip(REASON)
    root = tmp_path_factory.mktemp("vllm")
    tok = load_embedded_tokenizer()
    base = build_tiny_model(tok, seed=2, hidden=128, heads=4, init_std=0.3)
    base.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    policy = attach_lora(base, r=LAYOUT.r, alpha=LAYOUT.alpha, seed=0, target_modules=TARGETS)
    _perturb_adapter(policy, seed=1)
    engine = VLLMEngine(EngineConfig(model=str(root / "model"), threads=1, max_loras=3,
                                     max_lora_rank=8), log_path=root / "engine.log")
    renderer = ChatRenderer(tok, SYSTEM_PROMPT, list(AGENT_TOOLS))
    run = root / "run"
    registry = PolicyRegistry(run / "registry")
    generator = VLLMGenerator(engine, tok, base_checksum=policy_weight_checksum(policy)
                              .base_checksum, seed=3, raw_logprobs=True)
    replica = VLLMReplica(generator, WORKER, LAYOUT, root / "adapters", tolerance=1e-3)
    probe = Probe(tuple(renderer.render_prompt("probe: list the files")), SamplerConfig(T),
                  max_new_tokens=8)
    try:
        base_episodes = _base_episodes(root, engine, tok, renderer)
        manifest = _stage(registry, policy, renderer, "v0000")
        publish_proven(registry, "v0000", [replica], probe, trainer_probe_reference(policy, T))
    except BaseException:
        engine.close()
        raise
    try:
        yield dict(tok=tok, policy=policy, engine=engine, generator=generator, root=root,
                   base_episodes=base_episodes,
                   replica=replica, registry=registry, renderer=renderer, run=run,
                   manifest=manifest, probe=probe)
    finally:
        engine.close()


def _collect(generator, renderer, manifest, groups, writer=None):
    source = GeneratorSource(generator, renderer.action_text, SamplerConfig(T), 12, "vllm")
    collector = make_collector(source, manifest, CollectorParts(
        renderer, Verifier(), "vllm-run", writer, 3, sampling_salt=5))
    tasks = list_tasks(split="train")
    leases = [collector.make_lease(f"g{i}", tasks[i], 11, 4) for i in range(groups)]
    return [ep for g in collector.collect(leases) for ep in g.episodes]


@pytest.fixture(scope="module")
def episodes(world):
    """Two groups of four episodes the engine sampled at T = 0.7 under v0000 (traced)."""
    w = world
    (w["run"] / "traces").mkdir(parents=True, exist_ok=True)
    with TraceWriter(w["run"] / "traces" / "step-0000.jsonl") as writer:
        return _collect(w["generator"], w["renderer"], w["manifest"], 2, writer)


def _base_episodes(root, engine, tok, renderer):
    """One group sampled from the base weights with the engine's temperature-1 scores of the
    sampled ids (``raw_logprobs``), and a trainable copy of that base."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
    checksum = policy_weight_checksum(base).combined
    generator = VLLMGenerator(engine, tok, base_checksum=checksum, seed=4, raw_logprobs=True)
    manifest = build_manifest(policy_version="base", weight_checksum=checksum,
                              tokenizer_revision=sha256_hex("tok"), renderer=renderer,
                              sampler=SamplerConfig(temperature=T), step_budget=3,
                              max_action_tokens=12, model_id="tiny-vllm")
    return base, checksum, _collect(generator, renderer, manifest, 1)


@needs_vllm
@pytest.mark.slow  # starts the module's vLLM engine (40-150 s) and samples through it
def test_engine_behaviour_logprobs_are_the_trainers_tempered_logprobs(world, episodes):
    w = world
    tokens = sum(len(t.action_token_ids) for ep in episodes for t in ep.turns)
    assert tokens > 40 and all(ep.turns for ep in episodes)
    checksum = w["manifest"].weight_checksum
    assert w["generator"].weight_checksum == checksum
    audit = audit_logprobs(w["policy"], episodes, checksum, sampler=SamplerConfig(T),
                           tolerance_max=1e-3, tolerance_p95=1e-4)
    assert audit.compared == "behavior" and audit.temperature == T
    assert audit.passed, audit
    raw = audit_logprobs(w["policy"], episodes, checksum)  # the engine's temperature-1 scores
    assert raw.compared == "raw" and raw.passed, raw
    # the recorded log-probs are the tempered ones: scored at temperature 1 they fail
    wrong = audit_logprobs(w["policy"], episodes, checksum, sampler=SamplerConfig(1.0))
    assert not wrong.passed and wrong.abs_max > 1e-2


@needs_vllm
@pytest.mark.slow  # uses the module's engine
def test_same_streams_give_the_same_actions_and_truncation_is_refused(world):
    gen, prompt = world["generator"], list(world["probe"].prompt_ids)
    a = gen.generate(prompt, SamplerConfig(T), ["</tool_call>"], 10, seed=7)
    b = gen.generate(prompt, SamplerConfig(T), ["</tool_call>"], 10, seed=7)
    assert a == b and len(a.action_token_ids) > 0
    assert action_seed(7, 0) != action_seed(7, 1)
    with pytest.raises(GenerationError, match="top-k/top-p"):
        gen.generate(prompt, SamplerConfig(T, top_p=0.9), [], 4, seed=1)


def _ratio_run(metrics_list):
    config = {"rollout": {"temperature": T}, "update": {"objective": "reinforce_with_kl"},
              "consistency": {"max_abs_log_ratio": 1e-3}}
    steps = tuple({"kind": "rl_step", "step": i,
                   "metrics": {"ratio/abs_log_ratio_max": m["ratio/abs_log_ratio_max"],
                               "ratio/abs_log_ratio_p99": m["ratio/abs_log_ratio_p99"]}}
                  for i, m in enumerate(metrics_list))
    return RunDir(path=Path("/nonexistent"), config=config, config_meta={},
                  trainer={"objective": "reinforce_with_kl", "temperature": T}, tasks=None,
                  summary=None, audit=None, metrics=steps, traces={})


def _trainer_ratio_metrics(policy, episodes):
    # learning rate 0 and no clipping: the step scores the batch and leaves the weights be
    trainer = Trainer(policy, TrainerConfig(temperature=T, kl_beta=0.0, learning_rate=0.0,
                                            max_grad_norm=math.inf))
    batch = build_training_batch(episodes)
    metrics = trainer.step(batch, torch.linspace(-1, 1, len(episodes))).metrics
    trainer.optimizer.zero_grad(set_to_none=True)
    return metrics


@needs_vllm
@pytest.mark.slow  # uses the module's engine's episodes
def test_pre_temperature_logprobs_fail_the_ratio_gate(world):
    base, checksum, episodes = world["base_episodes"]
    raw = audit_logprobs(base, episodes, checksum)  # the engine's temperature-1 scores
    assert raw.compared == "raw" and raw.passed, raw
    fresh = _trainer_ratio_metrics(base, episodes)
    assert gate_ratio_on_policy(_ratio_run([fresh]), GateOptions()).passed is True
    # vLLM's default logprobs mode records log softmax(z) whatever the temperature: these are
    # the engine's own temperature-1 scores of the same ids, recorded as the behaviour
    raw_mode = [Episode(ep.trajectory, tuple(
        replace(t, behavior_logprobs=list(t.raw_model_logprobs)) for t in ep.turns))
        for ep in episodes]
    wrong = _trainer_ratio_metrics(base, raw_mode)
    gate = gate_ratio_on_policy(_ratio_run([wrong]), GateOptions())
    assert gate.passed is False and "max |log r|" in gate.detail
    assert wrong["ratio/abs_log_ratio_p99"] > 0.05


@needs_vllm
@pytest.mark.slow  # loads two more adapter versions into the module's engine
def test_an_adapter_that_never_reaches_the_engine_is_not_acknowledged(world, episodes,
                                                                      monkeypatch):
    w = world
    registry, replica, policy = w["registry"], w["replica"], w["policy"]
    _perturb_adapter(policy, seed=2)
    manifest = _stage(registry, policy, w["renderer"], "v0001")
    reference = trainer_probe_reference(policy, T)
    # the engine caches adapters by int id: re-using v0000's id with v0001's folder makes it
    # serve v0000's weights while the file it was handed (and hashes) is v0001's
    stale_id = w["generator"].active.lora_id
    fresh = replica._fresh_slot

    def reused_id(version, folder, checksum):
        slot = fresh(version, folder, checksum)
        slot.lora_id = stale_id
        return slot

    monkeypatch.setattr(replica, "_fresh_slot", reused_id)
    with pytest.raises(ReplicaProofError, match="probe log-probs differ") as caught:
        publish_proven(registry, "v0001", [replica], w["probe"], reference)
    proof = caught.value.proof
    assert proof.weights_match and not proof.probe_matches and proof.probe_max_abs > 1e-2
    assert registry.active().version == "v0000"
    assert w["generator"].weight_checksum == w["manifest"].weight_checksum
    with pytest.raises(MissingAckError):
        registry.publish("v0001", require_acks_from=[WORKER])
    gate = gate_weight_checksums(load_run(w["run"]), GateOptions())
    assert gate.passed is False and "versions without a worker ack: ['v0001']" in gate.detail
    saved = json.loads((registry.root / "proofs" / "v0001" / f"{WORKER}.json").read_text())
    assert saved["proven"] is False and saved["weights_match"] is True
    # the same version delivered under a fresh (name, id) is proven and published
    monkeypatch.undo()
    proofs = publish_proven(registry, "v0001", [replica], w["probe"], reference)
    assert proofs[0].proven and proofs[0].checksum_loaded == manifest.weight_checksum
    assert registry.active().version == "v0001"
    assert gate_weight_checksums(load_run(w["run"]), GateOptions()).passed is True


@needs_vllm
@pytest.mark.slow  # loads adapter versions into the module's engine
def test_a_corrupt_delivery_and_an_old_version_in_flight(world, monkeypatch):
    w = world
    registry, replica, gen, policy = w["registry"], w["replica"], w["generator"], w["policy"]
    sid = gen.open_session(list(w["probe"].prompt_ids), stream=1)  # pinned to the active one
    pinned = gen.active
    _perturb_adapter(policy, seed=3)
    version = f"v{len(registry.versions()):04d}"
    _stage(registry, policy, w["renderer"], version)
    import closedloop.engine.vllm_replica as replica_mod

    real_write = replica_mod.write_peft_adapter

    def corrupt(state, layout, folder):  # one tensor is damaged on its way to the engine
        name = sorted(state)[0]
        return real_write({**state, name: state[name] + 1.0}, layout, folder)

    monkeypatch.setattr(replica_mod, "write_peft_adapter", corrupt)
    with pytest.raises(ReplicaProofError, match="1 tensors differ") as caught:
        replica.load_version(registry, version, w["probe"], trainer_probe_reference(policy, T))
    assert not caught.value.proof.weights_match
    monkeypatch.undo()
    replica.load_version(registry, version, w["probe"], trainer_probe_reference(policy, T))
    loaded = set(w["engine"].call("list_loras")["loras"])
    assert {pinned.lora_id, gen.active.lora_id} <= loaded  # the old one still serves sid
    gen.generate_batch([sid], SamplerConfig(T), max_new_tokens=4)
    gen.close(sid)
    assert pinned.lora_id not in set(w["engine"].call("list_loras")["loras"])



class _SharedEngine:
    """The module's engine handed to a run, which must not stop it at its end."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def close(self):
        pass


@needs_vllm
@pytest.mark.slow  # a one-step tiny run whose RL step samples through the module's engine
def test_a_run_samples_its_rl_steps_through_the_engine(world, tmp_path, monkeypatch):
    import closedloop.engine as engine_pkg
    from closedloop.config import parse_config
    from closedloop.training.loop import train

    monkeypatch.setattr(engine_pkg, "VLLMEngine", lambda *a, **k: _SharedEngine(world["engine"]))
    # The random tiny Llama (head_dim 64, what the vLLM CPU kernels take) never closes a tool
    # call within 12 tokens, so every episode is censored and the run would stop as
    # unscorable (tests/evaluate/test_scorable.py tests that stop); this test is about what the
    # step samples and publishes through the engine, so it lets the step go on.
    import closedloop.training.rl_step as rl_step_module
    monkeypatch.setattr(rl_step_module, "require_scored", lambda *a, **k: None)
    data = {"model": str(world["root"] / "model"),
            "environment": {"train_tasks": 2, "heldout_tasks": 2, "max_turns": 3},
            "rollout": {"group_size": 4, "max_action_tokens": 12, "temperature": T,
                        "generator": "vllm"},
            "credit": {"censor_rule": "drop_censored"},
            "update": {"reference_policy": "initial"},
            "evaluation": {"attempts_per_task": 1, "retain_suites": [], "curve_points": 2,
                           "environment_family_disjoint": False,
                           "cold_start_train_eval": False},
            "training": {"rl_steps": 1, "groups_per_step": 2, "seed": 0,
                         "lora_rank": 4, "lora_alpha": 8, "lora_targets": list(TARGETS),
                         "precision": "float32"},
            "vllm": {"probe_tokens": 8}, "sft": {"enabled": False}}
    train(parse_config(data), tmp_path / "run", final_retain=False)
    run = load_run(tmp_path / "run")
    proofs = run.metrics_of("replica_proof")
    assert [p["label"] for p in proofs] == ["v0000", "v0001"] and all(p["proven"] for p in proofs)
    (audit,) = run.metrics_of("generator_audit")
    assert audit["passed"] and audit["compared"] == "behavior" and audit["n_tokens"] > 20
    builds = {t["generator_build"] for t in run.traces["step-0000"].raw("turn")}
    assert builds == {"vllm:0.32.0/float32/processed_logprobs"}
    assert gate_weight_checksums(run, GateOptions()).passed is True
    acks = sorted(p.name for p in (tmp_path / "run" / "registry" / "acks" / "v0001").iterdir())
    assert acks == ["generator-0.json", "vllm-0.json"]
