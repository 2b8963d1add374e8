"""The log-prob consistency auditor: |Δ| ≈ 0 at one version; fails on a dtype or a shifted mask."""

import copy
import dataclasses

import pytest
import torch

from closedloop.contracts import ContractError, Episode, SamplerConfig, sha256_hex
from closedloop.learn.logprob_audit import audit_logprobs, audit_tolerances
from closedloop.policy import build_tiny_model, load_embedded_tokenizer
from tests.learn.sampling import sample_episodes


@pytest.fixture(scope="module")
def sampled():
    """Multi-turn episodes sampled by the HF generator from a peaked tiny model."""
    tok = load_embedded_tokenizer()
    model = build_tiny_model(tok, seed=2, init_std=0.3)
    checksum, episodes = sample_episodes(model, tok, SamplerConfig(), siblings=3, max_turns=8,
                                         run_id="audit")
    return model, checksum, episodes


def test_same_version_fp32_passes(sampled):
    model, checksum, episodes = sampled
    result = audit_logprobs(model, episodes, checksum)
    assert result.n_tokens == sum(len(t.action_token_ids) for e in episodes for t in e.turns)
    assert result.abs_max < 1e-4
    assert result.abs_p95 <= result.abs_p99 <= result.abs_max
    assert 0 <= result.k3 < 1e-8
    assert result.passed


def test_bf16_trainer_path_fails_the_gate(sampled):
    model, checksum, episodes = sampled
    result = audit_logprobs(copy.deepcopy(model).to(torch.bfloat16), episodes, checksum)
    assert result.trainer_dtype == "bfloat16"
    assert result.abs_max > 1e-3
    assert not result.passed


def shift_logprobs(ep):
    """Misalign the recorded log-probs by one position (a mask shifted by one)."""
    turns = []
    for t in ep.turns:
        raw = t.raw_model_logprobs
        turns.append(dataclasses.replace(t, raw_model_logprobs=raw[1:] + raw[:1]))
    return Episode(ep.trajectory, tuple(turns))


def test_shifted_alignment_fails_the_gate(sampled):
    model, checksum, episodes = sampled
    result = audit_logprobs(model, [shift_logprobs(e) for e in episodes], checksum)
    assert result.abs_max > 1e-2
    assert not result.passed


def test_other_weights_are_not_a_same_version_audit(sampled):
    model, _, episodes = sampled
    with pytest.raises(ContractError, match="other weights"):
        audit_logprobs(model, episodes, sha256_hex("another version"))


# -- consistency.tolerance_source -------------------------------------------------------------
def test_fixed_tolerances_are_the_declared_ones(sampled):
    model, _, episodes = sampled
    bounds = audit_tolerances("fixed", 1e-3, model, episodes)
    assert (bounds.tolerance_max, bounds.tolerance_p95, bounds.tolerance_p99) == (1e-3, 1e-4, 1e-3)
    assert bounds.baseline_abs_max is None and bounds.baseline_abs_p99 is None


def test_the_bf16_baseline_admits_bf16_rounding_and_still_catches_a_misalignment(sampled):
    """An fp32 generator audited against a bf16-matmul trainer differs by bf16 rounding alone:
    a tight fixed tolerance fails it, the same-engine baseline (2 × |bf16 - fp32| of the trainer
    path) passes it, and a recorded log-prob off by 1 nat still fails under the baseline."""
    model, checksum, episodes = sampled
    tight = audit_tolerances("fixed", 1e-5, model, episodes)
    base = audit_tolerances("bf16_same_engine_baseline", 1e-5, model, episodes)
    assert base.baseline_abs_max is not None and base.baseline_abs_p95 is not None
    assert base.baseline_abs_max > 1e-5  # bf16 rounding moves log-probs: ~0.2 on this model
    assert base.tolerance_max == 2 * base.baseline_abs_max
    assert base.tolerance_p95 == max(1e-6, 2 * base.baseline_abs_p95)
    assert base.baseline_abs_p99 is not None
    assert base.baseline_abs_p95 <= base.baseline_abs_p99 <= base.baseline_abs_max
    assert base.tolerance_p99 == max(1e-5, 2 * base.baseline_abs_p99)
    verdicts = {}
    for name, b in (("fixed", tight), ("baseline", base)):
        verdicts[name] = audit_logprobs(model, episodes, checksum, precision="bfloat16",
                                        tolerance_max=b.tolerance_max,
                                        tolerance_p95=b.tolerance_p95).passed
    assert verdicts == {"fixed": False, "baseline": True}
    assert base.tolerance_max < 1.0
    first = episodes[0].turns[0]
    raw = list(first.raw_model_logprobs)
    raw[0] -= 1.0
    broken = Episode(episodes[0].trajectory, (dataclasses.replace(first, raw_model_logprobs=raw),
                                              *episodes[0].turns[1:]))
    off = audit_logprobs(model, [broken, *episodes[1:]], checksum,
                         tolerance_max=base.tolerance_max, tolerance_p95=base.tolerance_p95)
    assert off.abs_max > base.tolerance_max and not off.passed


def test_the_baseline_never_loosens_a_float32_audit(sampled):
    """A float32 run rounds to bf16 on neither side: its baseline bounds are the fixed ones, so
    an fp32 mismatch of 1e-2 (far below what bf16 rounding moves, far above fp32 noise) fails."""
    model, checksum, episodes = sampled
    bounds = audit_tolerances("bf16_same_engine_baseline", 1e-3, model, episodes,
                              precision="float32")
    assert (bounds.tolerance_max, bounds.tolerance_p95, bounds.tolerance_p99) == (1e-3, 1e-4, 1e-3)
    assert bounds.baseline_abs_max is None and bounds.baseline_abs_p99 is None
    first = episodes[0].turns[0]
    raw = list(first.raw_model_logprobs)
    raw[0] -= 1e-2
    off = Episode(episodes[0].trajectory, (dataclasses.replace(first, raw_model_logprobs=raw),
                                           *episodes[0].turns[1:]))
    result = audit_logprobs(model, [off, *episodes[1:]], checksum,
                            tolerance_max=bounds.tolerance_max,
                            tolerance_p95=bounds.tolerance_p95)
    assert not result.passed


def test_an_unknown_tolerance_source_is_refused(sampled):
    model, _, episodes = sampled
    with pytest.raises(ContractError, match="tolerance source"):
        audit_tolerances("eyeballed", 1e-3, model, episodes)
