"""A whole run at ``training.precision: bfloat16`` (design.md §7.6: train-inference mismatch
must not go unnoticed).

The tiny agent of ``tests.tiny_agent`` is trained by ``closedloop.training.loop.train`` (the real
collector, trainer, registry, ledger and auditor) with bf16 matmuls on both the generator and the
trainer path: the audit record and every published manifest must say how the policy computed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from closedloop.config import parse_config
from closedloop.contracts import load_episodes
from closedloop.engine import read_cpu_facts
from closedloop.envs.terminal.task_sets import build_task_sets
from closedloop.evaluate.gates.base import GateOptions
from closedloop.evaluate.gates.signal import gate_ratio_on_policy
from closedloop.evaluate.rundir import load_run
from closedloop.learn.logprob_audit import audit_logprobs
from closedloop.policy.registry import PolicyRegistry, version_name
from closedloop.rollout.tensors import build_training_batch
from closedloop.training.loop import train
from tests.tiny_agent import build_tiny_agent


def _real_host_emulates_bf16() -> bool:
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("CLOSEDLOOP_CPU_FLAGS", raising=False)
        return read_cpu_facts().native_bf16 is False


pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    _real_host_emulates_bf16(), reason="this CPU emulates bf16 (no amx_bf16/avx512_bf16): a "
    "whole bf16 run takes ~100 s here; the bf16 rule is tested in tests/engine/test_precision.py")]


@pytest.fixture(autouse=True)
def _own_host_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """This file runs bf16 for real, on the host's own (native) flags."""
    monkeypatch.delenv("CLOSEDLOOP_CPU_FLAGS", raising=False)

LABEL = "bfloat16-matmul/float32"


@pytest.fixture(scope="module")
def agent_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sets = build_task_sets(2, 2, seed=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        agent = build_tiny_agent(tmp_path_factory.mktemp("agent") / "model", sets.train_ids,
                                 sets.heldout_ids, seed=0)
    finally:
        torch.set_num_threads(threads)
    return agent.folder


def config(model_dir: Path) -> dict[str, Any]:
    return {
        "model": str(model_dir),
        "environment": {"train_tasks": 2, "heldout_tasks": 2, "max_turns": 6},
        "rollout": {"group_size": 4, "max_action_tokens": 64},
        "credit": {"censor_rule": "drop_censored"},
        "evaluation": {"attempts_per_task": 1, "retain_suites": []},
        "training": {"rl_steps": 1, "groups_per_step": 1, "precision": "bfloat16",
                     "package_check": "quick"},
        "sft": {"enabled": False},
    }


def same_engine_p95_bound(model: Any, episodes: list[Any]) -> float:
    """How far two bf16-matmul paths may put a typical (p95) log-prob apart on this model.

    At v0000 (LoRA B = 0, so the decode copy's merged weight is W itself) the generator and the
    trainer round the same inputs to bf16, and the bf16 x bf16 products are exact in fp32. They
    differ in fp32 accumulation order (fused projections, GEMM blocking, which depend on the
    host's kernels): per output |Δy| <= γ_K Σ_k |x_k w_k| with γ_K ≈ K·u_fp32, u_fp32 = 2^-24,
    K the deepest inner dimension (the MLP's down projection, intermediate_size). Where no bf16
    output rounding flips, a logit moves by at most about γ_K·|z|_max, and a log-prob by twice
    that (log-softmax is 2-Lipschitz in the max norm): bound = 2·K·2^-24·|z|_max, doubled for
    the two layers the error passes through. A flip (two fp32 results straddling a bf16
    rounding boundary) moves an output by one bf16 ulp (2^-7 relative, u_bf16 = 2^-8) and can
    reach the max |Δ| on any host (3e-5 on an AVX-512-bf16 EPYC, 3e-2 on other episodes here),
    but flips are rare (probability about |Δy| / ulp per element), so the p95 is held to the
    accumulation bound. An fp32 recomputation differs from bf16 by input rounding on every
    element, so it lies farther from the recorded log-probs than the bf16 recomputation.
    """
    batch = build_training_batch(episodes)
    with torch.no_grad():
        z_max = float(model(input_ids=batch.token_ids_B_T,
                            attention_mask=batch.attention_mask_B_T).logits.abs().max())
    depth = int(model.config.intermediate_size)
    return 2 * model.config.num_hidden_layers * 2 * depth * 2.0**-24 * z_max


def test_a_bf16_run_labels_its_manifests_and_audits_the_bf16_paths(agent_dir: Path,
                                                                   tmp_path: Path) -> None:
    summary = train(parse_config(config(agent_dir)), tmp_path / "run")
    assert summary
    audit = json.loads((tmp_path / "run" / "audit.json").read_text())
    # both paths computed with bf16 matmuls (on SmolLM2-135M their gap is ~1e-1;
    # tests/engine/test_precision.py covers a gate failing on it); the run's audit bound is the
    # seed's bf16 same-engine baseline
    assert audit["trainer_dtype"] == LABEL and audit["tolerance_source"] == (
        "bf16_same_engine_baseline")
    assert audit["n_tokens"] > 0 and audit["passed"] is True
    assert audit["abs_p99"] <= audit["abs_max"] and audit["tolerance_p99"] <= audit["tolerance_max"]
    # the on-policy RL step is gated on its p99 |log πθ/π_beh| against the audit's p99 bound
    ratio = gate_ratio_on_policy(load_run(tmp_path / "run"), GateOptions())
    assert ratio.passed is True, ratio.detail
    assert ratio.evidence["statistic"] == "ratio/abs_log_ratio_p99"
    trainer_cfg = json.loads((tmp_path / "run" / "trainer.json").read_text())
    assert trainer_cfg["precision"] == "bfloat16"
    # the generator really sampled in bf16: at v0000 the policy is the agent itself (a zero
    # adapter), and its recorded log-probs match a bf16 recomputation, not an fp32 one
    _, episodes = load_episodes(tmp_path / "run" / "traces" / "eval-start.jsonl")
    model = AutoModelForCausalLM.from_pretrained(agent_dir, dtype=torch.float32)
    checksum = episodes[0].trajectory.behavior_weight_checksum
    same = audit_logprobs(model, episodes, checksum, precision="bfloat16")
    fp32 = audit_logprobs(model, episodes, checksum, precision="float32")
    # the bf16 recomputation is within the accumulation bound and strictly closer than fp32's
    # (how far fp32 lies depends on how peaked the sampled tokens are, so it is not bounded)
    assert same.abs_p95 <= same_engine_p95_bound(model, episodes)
    assert same.abs_p95 < fp32.abs_p95
    registry = PolicyRegistry(tmp_path / "run" / "registry")
    for version in (version_name(0), version_name(1)):
        manifest = registry.manifest(version)
        assert manifest.dtype == LABEL
        assert LABEL in manifest.generator_build
