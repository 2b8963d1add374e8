"""The update contract at any sampler temperature: the trainer scores softmax(z/τ), the
distribution that drew the tokens, so a fresh on-policy batch has ratio 1; the ratio gate fails
a run whose trainer scored at another temperature, and the learning-signal gate refuses to pass
a run that received no gradient."""

from pathlib import Path

import pytest
import torch

from closedloop.contracts import SamplerConfig
from closedloop.evaluate.gates.base import GateOptions
from closedloop.evaluate.gates.signal import gate_learning_signal, gate_ratio_on_policy
from closedloop.evaluate.rundir import RunDir
from closedloop.learn.audit import audit_logprobs
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
    trainer = Trainer(model, TrainerConfig(temperature=temperature, kl_beta=0.0))
    batch = build_training_batch(episodes)
    adv = torch.linspace(-1, 1, len(episodes))
    metrics, _, _ = trainer.accumulate_gradients(batch, adv)
    trainer.optimizer.zero_grad(set_to_none=True)
    return metrics


def test_a_fresh_batch_sampled_at_07_has_ratio_one_when_scored_at_07(tempered_episodes):
    model, _, episodes = tempered_episodes
    metrics = _ratio_metrics(model, episodes, TEMPERATURE)
    assert metrics["ratio/abs_log_ratio_max"] <= 1e-3
    assert abs(metrics["ratio/ratio_max"] - 1) <= 1e-3


def test_scoring_the_same_batch_at_temperature_one_breaks_the_ratio(tempered_episodes):
    model, _, episodes = tempered_episodes
    metrics = _ratio_metrics(model, episodes, 1.0)
    assert metrics["ratio/abs_log_ratio_max"] > 1e-2


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


def _step(step, log_ratio_max, scored=2, zero=0, grad=0.5, mass=1.0):
    return {"step": step, "zero_variance": zero, "credit": {"n_scored_groups": scored},
            "metrics": {"ratio/abs_log_ratio_max": log_ratio_max, "optim/grad_norm": grad,
                        "grad_mass/grad_mass_total": mass}}


@pytest.mark.parametrize("temperature", [TEMPERATURE, 1.0])
def test_the_ratio_gate_passes_an_on_policy_run_at_either_temperature(temperature,
                                                                      tempered_episodes):
    model, _, episodes = tempered_episodes
    measured = _ratio_metrics(model, episodes, TEMPERATURE)["ratio/abs_log_ratio_max"]
    run = _run(temperature, [_step(0, measured), _step(1, measured)])
    run.config["rollout"]["temperature"] = temperature
    gate = gate_ratio_on_policy(run, GateOptions())
    assert gate.passed is True, gate.detail


def test_the_ratio_gate_fails_a_run_scored_at_the_wrong_temperature(tempered_episodes):
    model, _, episodes = tempered_episodes
    measured = _ratio_metrics(model, episodes, 1.0)["ratio/abs_log_ratio_max"]
    gate = gate_ratio_on_policy(_run(1.0, [_step(0, measured)]), GateOptions())
    assert gate.passed is False
    assert "temperature 1.0" in gate.detail and "max |log r|" in gate.detail


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


def test_a_bf16_run_declares_its_ratio_bound_through_the_audit_baseline():
    run = _run(TEMPERATURE, [_step(0, 0.05)])
    assert gate_ratio_on_policy(run, GateOptions()).passed is False  # 0.05 > 1e-3 in fp32
    run.config["training"] = {"precision": "bfloat16"}
    audit = {"tolerance_source": "bf16_same_engine_baseline", "tolerance_max": 0.3}
    bf16 = RunDir(**{**run.__dict__, "audit": audit})
    gate = gate_ratio_on_policy(bf16, GateOptions())
    assert gate.passed is True and gate.evidence["tolerance"] == 0.3
    assert gate.evidence["tolerance_source"].startswith("audit.json")
    tails = RunDir(**{**bf16.__dict__, "metrics": ({"kind": "rl_step", **_step(0, 0.5)},)})
    assert gate_ratio_on_policy(tails, GateOptions()).passed is False  # beyond the baseline
