"""Every config key changes what the run does, or its unimplemented values are refused naming the
key. The seed's smoke YAML (configs/smoke_seed.yaml) holds the honoured values; each test below
changes one key of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from closedloop.config import parse_config
from closedloop.contracts import ConfigError

SEED_YAML = Path(__file__).resolve().parent.parent / "configs" / "smoke_seed.yaml"


def seed_with(key: str, value: Any, **extra: Any) -> dict[str, Any]:
    """The seed's YAML with dotted ``key`` (and ``extra``, ``section__name=value``) set."""
    data: dict[str, Any] = yaml.safe_load(SEED_YAML.read_text(encoding="utf-8"))
    for dotted, v in [(key, value), *((k.replace("__", "."), v) for k, v in extra.items())]:
        *sections, name = dotted.split(".")
        node = data
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = v
    return data


# keys accepted by the seed's YAML whose other values nothing implements: refused, key named
REFUSED = [
    ("trainable", "full"),
    ("policy.require_manifest", False),
    ("policy.lock_scaffold_across_checkpoints", False),
    ("environment.domain", "web_browsing"),
    ("environment.reset_each_episode", False),
    ("environment.snapshot_backend", "overlayfs"),
    ("environment.base_snapshot_per_task", False),
    ("environment.branching", True),
    ("rollout.mode", "asynchronous"),  # the value is "async"
    ("rollout.pin_policy_for_full_episode", False),
    ("rollout.max_version_lag", 1),
    ("rollout.require_one_behavior_version_per_group", False),
    ("rollout.in_flight_policy", "abort"),
    ("rollout.partial_episode_policy", "continue"),
    ("rollout.require_termination_reason", False),
    ("rollout.context_compaction", True),
    ("consistency.audit_frozen_checkpoint", False),
    ("consistency.tolerance_source", "vllm_baseline"),
    ("weight_sync.transport", "nccl"),
    ("weight_sync.publish", "immediate"),
    ("weight_sync.require_all_worker_checksums", False),
    ("weight_sync.kv_cache_on_update", "keep"),
    ("update.behavior_policy", "latest"),
    ("update.proximal_policy", "current"),
    ("update.optimizer_steps_per_fresh_batch", 2),  # reinforce_with_kl has no ratio to reuse with
    ("evaluation.temporal_cutoff", "2024-06-01"),
    ("evaluation.repository_overlap_audit", "exact"),
    ("training.dtype", "bfloat16"),
]


@pytest.mark.parametrize(("key", "value"), REFUSED, ids=[k for k, _ in REFUSED])
def test_an_unimplemented_value_is_refused_naming_its_key(key: str, value: Any) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(seed_with(key, value))
    assert key in str(err.value)


def test_reference_policy_initial_is_refused_with_sft_and_the_same_weights_without() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(seed_with("update.reference_policy", "initial"))
    assert "update.reference_policy" in str(err.value)
    cfg = parse_config(seed_with("update.reference_policy", "initial", sft__enabled=False))
    assert cfg.update.reference_policy == "initial" and not cfg.sft.enabled


def test_fewer_evaluation_seeds_than_attempts_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(seed_with("evaluation.attempts_per_task", 4))  # 3 seeds in the YAML
    assert "evaluation.seeds" in str(err.value)
    assert parse_config(seed_with("evaluation.attempts_per_task", 2)).evaluation.seeds == [
        11, 22, 33]


def test_ppo_clip_may_reuse_a_batch() -> None:
    cfg = parse_config(seed_with("update.objective", "ppo_clip",
                                 update__optimizer_steps_per_fresh_batch=3))
    assert cfg.update.optimizer_steps_per_fresh_batch == 3


def test_freshness_and_placement_are_valid_with_an_explicit_off_policy_correction() -> None:
    with pytest.raises(ConfigError, match="explicit off-policy") as err:
        parse_config(seed_with("rollout.max_version_lag", 1))  # reinforce_with_kl: no ratio
    assert "rollout.max_version_lag" in str(err.value)
    cfg = parse_config(seed_with("rollout.max_version_lag", 1, rollout__mode="async",
                                 update__objective="ppo_clip",
                                 update__proximal_policy="trainer_at_step_start"))
    assert (cfg.rollout.mode, cfg.rollout.max_version_lag) == ("async", 1)
    assert parse_config(seed_with("rollout.mode", "async")).rollout.max_version_lag == 0
    with pytest.raises(ConfigError, match=r"update\.proximal_policy"):
        parse_config(seed_with("update.proximal_policy", "trainer_at_step_start"))
    with pytest.raises(ConfigError, match=r"rollout\.max_sample_drift"):
        parse_config(seed_with("rollout.max_sample_drift", 0.0))
    assert parse_config(seed_with("rollout.max_sample_drift", 0.05)).rollout.max_sample_drift \
        == 0.05


def test_an_in_flight_policy_needs_a_boundary_a_lag_and_its_label() -> None:
    ok = dict(rollout__max_version_lag=1, update__objective="ppo_clip",
              rollout__partial_rollout_turns=2)
    with pytest.raises(ConfigError, match=r"rollout\.in_flight_policy"):
        parse_config(seed_with("rollout.in_flight_policy", "abort_and_restart",
                               update__objective="ppo_clip", rollout__max_version_lag=1))
    assert parse_config(seed_with("rollout.in_flight_policy", "abort_and_restart", **ok)
                        ).rollout.in_flight_policy == "abort_and_restart"
    with pytest.raises(ConfigError, match=r"rollout\.pin_policy_for_full_episode"):
        parse_config(seed_with("rollout.in_flight_policy", "mixed_policy", **ok))
    cfg = parse_config(seed_with("rollout.in_flight_policy", "mixed_policy",
                                 rollout__pin_policy_for_full_episode=False, **ok))
    assert not cfg.rollout.pin_policy_for_full_episode


def test_credit_estimators_are_honoured_or_refused_by_name() -> None:
    for name in ("rloo", "grpo", "dr_grpo", "gae"):
        assert parse_config(seed_with("credit.estimator", name)).credit.estimator == name
    gae = parse_config(seed_with("credit.estimator", "gae", credit__gamma=0.9,
                                 credit__gae_lambda=0.5, credit__critic_learning_rate=3e-4))
    assert (gae.credit.gamma, gae.credit.gae_lambda) == (0.9, 0.5)
    for key, value in (("credit.gamma", 1.5), ("credit.gae_lambda", -0.1),
                       ("credit.critic_learning_rate", 0.0),
                       ("credit.reward_control", "shuffle_within_group")):
        with pytest.raises(ConfigError) as err:
            parse_config(seed_with("credit.estimator", "gae", **{key.replace(".", "__"): value}))
        assert key in str(err.value)
    for key in ("credit.gamma", "credit.gae_lambda", "credit.critic_learning_rate"):
        with pytest.raises(ConfigError) as err:  # read only by the gae estimator
            parse_config(seed_with(key, 0.5))
        assert key in str(err.value)
    with pytest.raises(ConfigError) as err:
        parse_config(seed_with("credit.estimator", "td_lambda"))
    assert "credit.estimator" in str(err.value)
    for key, value in (("credit.branch_k", 8), ("credit.branch_rule", "max_surprisal"),
                       ("credit.branch_episodes_per_group", 1)):
        with pytest.raises(ConfigError) as err:  # read only by the branching estimator
            parse_config(seed_with(key, value))
        assert key in str(err.value)


def test_the_experiment_arm_reads_the_branching_keys_and_train_refuses_it(tmp_path: Path
                                                                          ) -> None:
    cfg = parse_config(seed_with("credit.experiment_arm", "branching",
                                 credit__branch_k=3))
    assert cfg.credit.experiment_arm == "branching" and cfg.credit.branch_k == 3
    assert not cfg.environment.branching  # the RL arm itself does not fork
    gae_arm = parse_config(seed_with("credit.experiment_arm", "gae", credit__gamma=0.9))
    assert gae_arm.credit.gamma == 0.9 and gae_arm.credit.estimator == "rloo"
    with pytest.raises(ConfigError) as err:
        parse_config(seed_with("credit.experiment_arm", "td_lambda"))
    assert "credit.experiment_arm" in str(err.value)
    with pytest.raises(ConfigError) as err:  # the RL arm is branching already
        parse_config(seed_with("credit.experiment_arm", "branching",
                               credit__estimator="branching", environment__branching=True))
    assert "credit.experiment_arm" in str(err.value)
    branching = parse_config(seed_with("credit.estimator", "branching",
                                       environment__branching=True,
                                       credit__branch_rule="max_surprisal"))
    assert branching.credit.branch_rule == "max_surprisal"
    with pytest.raises(ConfigError) as err:
        parse_config(seed_with("credit.estimator", "branching"))  # environment.branching false
    assert "environment.branching" in str(err.value)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(seed_with("credit.experiment_arm", "branching")))
    from closedloop.cli import main
    assert main(["train", str(path), "--run-dir", str(tmp_path / "run")]) != 0
    assert not (tmp_path / "run").exists()


def test_turn_level_credit_is_refused_outside_the_synchronous_loop() -> None:
    for estimator, extra in (("gae", {}), ("branching", {"environment__branching": True})):
        with pytest.raises(ConfigError) as err:
            parse_config(seed_with("credit.estimator", estimator, rollout__mode="async",
                                   update__objective="ppo_clip", **extra))
        assert "credit.estimator" in str(err.value)
    with pytest.raises(ConfigError) as err:
        parse_config(seed_with("credit.experiment_arm", "gae", rollout__max_version_lag=1,
                               update__objective="ppo_clip"))
    assert "credit.experiment_arm" in str(err.value)


@pytest.mark.parametrize(("key", "value", "extra", "named"), [
    ("rollout.top_p", 0.9, {"rollout__generator": "vllm", "update__objective": "ppo_clip"},
     "rollout.top_p"),
    ("rollout.generator", "vllm", {"training__precision": "bfloat16"}, "training.precision"),
    ("rollout.generator", "vllm", {"rollout__workers": "ray"}, "rollout.workers"),
    ("rollout.workers", "ray", {"rollout__max_version_lag": 1, "update__objective": "ppo_clip"},
     "rollout.max_version_lag"),
    ("rollout.generator", "vllm", {"rollout__max_version_lag": 1, "update__objective": "ppo_clip",
                                   "rollout__partial_rollout_turns": 2},
     "rollout.max_version_lag"),
    ("ray.env_worker_cpus", 0.0, {}, "ray.env_worker_cpus"),
    ("ray.generator_workers", 0, {}, "ray.generator_workers"),
])
def test_scale_out_keys_refuse_what_they_cannot_honour(key: str, value: Any,
                                                       extra: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(seed_with(key, value, **extra))
    assert caught.value.key == named


def test_scale_out_keys_parse() -> None:
    cfg = parse_config(seed_with("rollout.workers", "ray", ray__env_workers=3,
                                 ray__env_worker_cpus=0.5, ray__address="10.0.0.1:6379"))
    assert cfg.rollout.workers == "ray" and cfg.ray.env_workers == 3
    assert cfg.ray.address == "10.0.0.1:6379" and cfg.rollout.generator == "hf"
