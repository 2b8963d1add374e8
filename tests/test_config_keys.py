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
    ("rollout.mode", "asynchronous"),
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


@pytest.mark.parametrize(("key", "value", "extra", "named"), [
    ("rollout.top_p", 0.9, {"rollout__generator": "vllm", "update__objective": "ppo_clip"},
     "rollout.top_p"),
    ("rollout.generator", "vllm", {"training__precision": "bfloat16"}, "training.precision"),
    ("rollout.generator", "vllm", {"rollout__workers": "ray"}, "rollout.workers"),
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
