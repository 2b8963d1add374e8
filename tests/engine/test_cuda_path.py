"""The embedded engine and the trainer on each device torch sees: the same contracts there.

Parametrized over ``cpu`` and ``cuda`` (skipped, naming why, without a CUDA device;
``scripts/gpu-check`` runs this file on a GPU machine). On every device: the generator's
recorded log-probs are the trainer path's at the sampler's temperature (the audit passes), a
fresh batch has ratio 1 in the trainer, the update moves the adapter and leaves it on the
device; on CUDA with native bf16, a bf16 audit stays within its same-engine baseline.
"""

from __future__ import annotations

import math

import pytest
import torch

from closedloop.contracts import SamplerConfig
from closedloop.engine import model_device, resolve_device, resolve_on_cuda
from closedloop.learn.logprob_audit import audit_logprobs, audit_tolerances
from closedloop.learn.trainer import Trainer, TrainerConfig
from closedloop.policy import build_tiny_model
from closedloop.policy.lora import attach_lora, split_state_dict
from closedloop.rollout.tensors import build_training_batch
from tests.learn.sampling import sample_episodes

T = 0.7
NO_CUDA = "no CUDA device: the cuda case runs where torch sees one (scripts/gpu-check)"
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason=NO_CUDA))]


def _policy(tokenizer, device):
    model = attach_lora(build_tiny_model(tokenizer, seed=2, init_std=0.3), r=4, alpha=8, seed=0)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.to(device)


@pytest.fixture(scope="module", params=DEVICES)
def on_device(request, tokenizer):
    device = request.param
    model = _policy(tokenizer, device)
    checksum, episodes = sample_episodes(model, tokenizer, SamplerConfig(temperature=T),
                                         siblings=4, max_turns=3, run_id=f"dev-{device}")
    return device, model, checksum, episodes


def test_the_generator_records_the_trainers_tempered_logprobs_on_the_device(on_device):
    device, model, checksum, episodes = on_device
    assert model_device(model).type == device
    assert sum(len(t.action_token_ids) for ep in episodes for t in ep.turns) > 20
    audit = audit_logprobs(model, episodes, checksum, sampler=SamplerConfig(temperature=T))
    assert audit.compared == "behavior" and audit.passed, audit
    wrong = audit_logprobs(model, episodes, checksum, sampler=SamplerConfig(temperature=1.0))
    assert not wrong.passed  # the audit can fail on the device: scored at the wrong T


def test_a_fresh_batch_has_ratio_one_and_the_update_stays_on_the_device(on_device):
    device, model, _, episodes = on_device
    before = {k: v.detach().clone() for k, v in split_state_dict(model)[1].items()}
    trainer = Trainer(model, TrainerConfig(temperature=T, kl_beta=0.0, learning_rate=1e-2,
                                           max_grad_norm=math.inf))
    result = trainer.step(build_training_batch(episodes), torch.linspace(-1, 1, len(episodes)))
    assert result.metrics["ratio/abs_log_ratio_max"] <= 1e-3
    assert math.isfinite(result.grad_norm) and result.grad_norm > 0
    after = split_state_dict(model)[1]
    assert all(t.device.type == device for t in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.is_bf16_supported()),
                    reason="no CUDA device with native bf16")
def test_a_bf16_audit_on_cuda_stays_within_its_same_engine_baseline(tokenizer):
    model = _policy(tokenizer, "cuda")
    sampler = SamplerConfig(temperature=T)
    checksum, episodes = sample_episodes(model, tokenizer, sampler, siblings=4, max_turns=3,
                                         run_id="bf16-cuda")
    tol = audit_tolerances("bf16_same_engine_baseline", 1e-3, model, episodes, sampler=sampler,
                           precision="bfloat16")
    audit = audit_logprobs(model, episodes, checksum, sampler=sampler, precision="float32",
                           tolerance_max=tol.tolerance_max, tolerance_p95=tol.tolerance_p95)
    assert audit.passed, (audit, tol)


def test_the_precision_policy_on_cuda_follows_the_gpu():
    assert resolve_on_cuda("auto", bf16_supported=True, name="H200").precision == "bfloat16"
    native = resolve_on_cuda("auto", bf16_supported=False, name="T4")
    assert native.precision == "float32" and native.device == "cuda"
    assert resolve_on_cuda("float32", bf16_supported=True, name="H200").precision == "float32"
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
