"""The update contract at any sampler temperature: the trainer scores softmax(z/τ), the
distribution that drew the tokens, so a fresh on-policy batch has ratio 1; the ratio gate fails
a run whose trainer scored at another temperature, and the learning-signal gate refuses to pass
a run that received no gradient."""

import math
from pathlib import Path

import pytest
import torch

from closedloop.contracts import SamplerConfig
from closedloop.evaluate.gates.base import GateOptions
from closedloop.evaluate.gates.signal import gate_learning_signal, gate_ratio_on_policy
from closedloop.evaluate.rundir import RunDir
from closedloop.learn.logprob_audit import audit_logprobs
from closedloop.learn.trainer import Trainer, TrainerConfig
from closedloop.policy import build_tiny_model, load_embedded_tokenizer
from closedloop.policy.lora import attach_lora
from closedloop.rollout.tensors import build_training_batch
from tests.learn.sampling import sample_episodes

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def tempered_episodes():
    """Multi-turn episodes the HF generator sampled at τ = 0.7 from a LoRA-wrapped tiny model."""
    tok = load_embedded_tokenizer()
    model = attach_lora(build_tiny_model(tok, seed=2, init_std=0.3), r=4, alpha=8, seed=0)
    checksum, episodes = sample_episodes(model, tok, SamplerConfig(temperature=TEMPERATURE),
                                         siblings=4, max_turns=4, run_id="tempered")
    return model, checksum, episodes


def _ratio_metrics(model, episodes, temperature):
    # learning rate 0 and no clipping: the step scores the batch and leaves the weights be
    trainer = Trainer(model, TrainerConfig(temperature=temperature, kl_beta=0.0,
                                           learning_rate=0.0, max_grad_norm=math.inf))
    batch = build_training_batch(episodes)
    adv = torch.linspace(-1, 1, len(episodes))
    metrics = trainer.step(batch, adv).metrics
    trainer.optimizer.zero_grad(set_to_none=True)
    return metrics


def test_a_fresh_batch_sampled_at_07_has_ratio_one_when_scored_at_07(tempered_episodes):
    model, _, episodes = tempered_episodes
    metrics = _ratio_metrics(model, episodes, TEMPERATURE)
    assert metrics["ratio/abs_log_ratio_max"] <= 1e-3
    assert metrics["ratio/abs_log_ratio_p99"] <= metrics["ratio/abs_log_ratio_max"]
    assert abs(metrics["ratio/ratio_max"] - 1) <= 1e-3


def test_scoring_the_same_batch_at_temperature_one_breaks_the_ratio(tempered_episodes):
    model, _, episodes = tempered_episodes
    metrics = _ratio_metrics(model, episodes, 1.0)
    assert metrics["ratio/abs_log_ratio_max"] > 1e-2
    assert metrics["ratio/abs_log_ratio_p99"] > 1e-2  # not a rare-token tail: most tokens move


def test_the_auditor_compares_the_tempered_behaviour_logprobs(tempered_episodes):
    model, checksum, episodes = tempered_episodes
    sampler = SamplerConfig(temperature=TEMPERATURE)
    tempered = audit_logprobs(model, episodes, checksum, sampler=sampler)
    assert tempered.compared == "behavior" and tempered.temperature == TEMPERATURE
    assert tempered.passed and tempered.abs_max < 1e-4
    raw = audit_logprobs(model, episodes, checksum)  # temperature 1 against the raw log-probs
    assert raw.compared == "raw" and raw.passed


def _run(trainer_t: float, rl_steps: list[dict], objective: str = "reinforce_with_kl") -> RunDir:
    config = {"rollout": {"temperature": TEMPERATURE}, "update": {"objective": objective},
              "consistency": {"max_abs_log_ratio": 1e-3},
              "evaluation": {"min_informative_group_fraction": 0.25,
                             "min_signal_step_fraction": 0.5}}
    return RunDir(path=Path("/nonexistent"), config=config, config_meta={},
                  trainer={"objective": objective, "temperature": trainer_t}, tasks=None,
                  summary=None, audit=None,
                  metrics=tuple({"kind": "rl_step", **r} for r in rl_steps), traces={})


def _step(step, log_ratio_max, scored=2, zero=0, grad=0.5, mass=1.0, p99=None):
    metrics = {"ratio/abs_log_ratio_max": log_ratio_max, "optim/grad_norm": grad,
               "grad_mass/grad_mass_total": mass}
    if p99 is not None:
        metrics["ratio/abs_log_ratio_p99"] = p99
    return {"step": step, "zero_variance": zero, "credit": {"n_scored_groups": scored},
            "metrics": metrics}


def _measured_step(step, metrics):
    return _step(step, metrics["ratio/abs_log_ratio_max"],
                 p99=metrics["ratio/abs_log_ratio_p99"])


# A bf16 audit of the measured failure: 2 × the same-engine change's max 0.555, its p99 0.04.
BF16_AUDIT = {"tolerance_source": "bf16_same_engine_baseline", "tolerance_max": 0.555,
              "tolerance_p99": 0.04}


def _bf16(run: RunDir, audit=BF16_AUDIT) -> RunDir:
    run.config["training"] = {"precision": "bfloat16"}
    return RunDir(**{**run.__dict__, "audit": audit})


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("temperature", [TEMPERATURE, 1.0])
def test_the_ratio_gate_passes_an_on_policy_run_at_either_temperature(temperature, precision,
                                                                      tempered_episodes):
    model, _, episodes = tempered_episodes
    measured = _ratio_metrics(model, episodes, TEMPERATURE)
    run = _run(temperature, [_measured_step(0, measured), _measured_step(1, measured)])
    run.config["rollout"]["temperature"] = temperature
    if precision == "bfloat16":
        run = _bf16(run)
    gate = gate_ratio_on_policy(run, GateOptions())
    assert gate.passed is True, gate.detail


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_the_ratio_gate_fails_a_run_scored_at_the_wrong_temperature(precision,
                                                                   tempered_episodes):
    model, _, episodes = tempered_episodes
    run = _run(1.0, [_measured_step(0, _ratio_metrics(model, episodes, 1.0))])
    if precision == "bfloat16":
        run = _bf16(run)
    gate = gate_ratio_on_policy(run, GateOptions())
    assert gate.passed is False
    stat = "p99" if precision == "bfloat16" else "max"
    assert "temperature 1.0" in gate.detail and f"{stat} |log r|" in gate.detail


def test_the_ratio_gate_does_not_apply_to_an_objective_with_ratios():
    gate = gate_ratio_on_policy(_run(1.0, [_step(0, 0.5)], objective="ppo_clip"), GateOptions())
    assert gate.status == "N/A"


def test_learning_signal_is_not_measured_when_every_group_was_zero_variance():
    run = _run(TEMPERATURE, [_step(0, 0.0, scored=2, zero=2, grad=0.0, mass=0.0),
                             _step(1, 0.0, scored=2, zero=2, grad=0.0, mass=0.0)])
    gate = gate_learning_signal(run, GateOptions())
    assert gate.passed is None and gate.status == "NOT MEASURED"
    assert "no learning signal" in gate.detail
    assert gate.evidence["informative_groups"] == 0


def test_learning_signal_below_the_preregistered_minimum_is_not_measured():
    run = _run(TEMPERATURE, [_step(0, 0.0, scored=4, zero=4, grad=0.0, mass=0.0),
                             _step(1, 0.0, scored=4, zero=3)])
    gate = gate_learning_signal(run, GateOptions())
    assert gate.passed is None and "too little learning signal" in gate.detail


def test_learning_signal_passes_with_informative_groups_that_moved_theta():
    run = _run(TEMPERATURE, [_step(0, 0.0, scored=4, zero=2), _step(1, 0.0, scored=4, zero=1)])
    gate = gate_learning_signal(run, GateOptions())
    assert gate.passed is True
    assert gate.evidence["informative_fraction"] == pytest.approx(5 / 8)


def test_a_bf16_run_is_gated_on_its_step_p99_within_the_audits_p99_bound():
    """The measured bf16 case: a step max of 0.589 above the audit's max bound 0.555 (a max
    grows with the tokens it is taken over), its p99 0.03 within the audit's p99 bound 0.04."""
    steps = [_step(0, 0.589, p99=0.03), _step(1, 0.2, p99=0.01)]
    assert gate_ratio_on_policy(_run(TEMPERATURE, steps), GateOptions()).passed is False  # fp32
    gate = gate_ratio_on_policy(_bf16(_run(TEMPERATURE, steps)), GateOptions())
    assert gate.passed is True, gate.detail
    assert gate.evidence["statistic"] == "ratio/abs_log_ratio_p99"
    assert gate.evidence["tolerance"] == 0.04
    assert gate.evidence["tolerance_source"].startswith("audit.json tolerance_p99")
    assert gate.evidence["max_abs_log_ratio"] == 0.589
    assert gate.evidence["max_abs_log_ratio_p99"] == 0.03
    assert "not gated" in gate.detail


def test_a_bf16_run_whose_step_p99_exceeds_the_audits_bound_fails():
    run = _bf16(_run(TEMPERATURE, [_step(0, 0.3, p99=0.01), _step(1, 0.3, p99=0.05)]))
    gate = gate_ratio_on_policy(run, GateOptions())
    assert gate.passed is False and gate.evidence["steps_over"] == 1
    assert "step 1: p99 |log r| = 0.05 > 0.04" in gate.detail


def test_a_bf16_step_that_logged_no_p99_fails_naming_the_key():
    run = _bf16(_run(TEMPERATURE, [_step(0, 0.01, p99=0.01), _step(1, 0.01)]))
    gate = gate_ratio_on_policy(run, GateOptions())
    assert gate.passed is False
    assert gate.detail == "step 1 logged no ratio/abs_log_ratio_p99"


def test_only_a_bf16_run_audited_against_the_bf16_baseline_is_gated_on_the_p99():
    steps = [_step(0, 0.05, p99=0.01)]
    # float32 with the same audit: the max against consistency.max_abs_log_ratio
    fp32 = gate_ratio_on_policy(RunDir(**{**_run(TEMPERATURE, steps).__dict__,
                                          "audit": BF16_AUDIT}), GateOptions())
    assert fp32.passed is False and fp32.evidence["statistic"] == "ratio/abs_log_ratio_max"
    assert "step 0: max |log r| = 0.05 > 0.001" in fp32.detail
    # bfloat16 audited with the fixed source: the same
    fixed = {"tolerance_source": "fixed", "tolerance_max": 1e-3, "tolerance_p99": 1e-3}
    gate = gate_ratio_on_policy(_bf16(_run(TEMPERATURE, steps), fixed), GateOptions())
    assert gate.passed is False and gate.evidence["tolerance"] == 1e-3
    assert gate.evidence["statistic"] == "ratio/abs_log_ratio_max"
    # a bf16 baseline audit.json without tolerance_p99: the declared bound caps the p99
    old = {"tolerance_source": "bf16_same_engine_baseline", "tolerance_max": 0.555}
    gate = gate_ratio_on_policy(_bf16(_run(TEMPERATURE, steps), old), GateOptions())
    assert gate.passed is False and gate.evidence["tolerance"] == 1e-3
    assert "audit.json has no tolerance_p99" in gate.detail
