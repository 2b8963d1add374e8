"""The run config: the seed's smoke YAML is valid as written; bad input names the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from closedloop.config import load_config, parse_config, smoke_config
from closedloop.contracts import ConfigError

SEED_YAML = Path(__file__).resolve().parent.parent / "configs" / "smoke_seed.yaml"


def seed_data() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(SEED_YAML.read_text(encoding="utf-8"))
    return data


def test_the_seed_yaml_is_valid_as_written() -> None:
    cfg = load_config(SEED_YAML)
    assert cfg.model == "embedded"
    assert cfg.rollout.group_size == 8
    assert cfg.training.precision == "auto"  # resolved once per run from the host


def test_resolved_config_round_trips_and_hashes_stably() -> None:
    cfg = load_config(SEED_YAML)
    again = parse_config(cfg.to_dict())
    assert again == cfg
    assert again.config_hash() == cfg.config_hash()
    assert smoke_config().config_hash() != cfg.config_hash()


@pytest.mark.parametrize(("path", "value", "key"), [
    (("rollout", "group_sise"), 8, "rollout.group_sise"),          # misspelled key
    (("rollout", "group_size"), "eight", "rollout.group_size"),    # wrong type
    (("credit", "estimator"), "ppo", "credit.estimator"),          # outside the allowed set
    (("training", "precision"), "fp16", "training.precision"),
    (("training", "precision"), "bf16", "training.precision"),
    (("rollout", "group_size"), 1, "rollout.group_size"),          # range
])
def test_bad_input_is_rejected_with_the_dotted_key(path: tuple[str, str], value: Any,
                                                    key: str) -> None:
    data = seed_data()
    data.setdefault(path[0], {})[path[1]] = value
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert key in str(err.value)


def test_bfloat16_precision_is_accepted_and_changes_the_hash() -> None:
    data = seed_data()
    data["training"] = {"precision": "bfloat16"}
    cfg = parse_config(data)
    assert cfg.training.precision == "bfloat16"
    assert cfg.config_hash() != load_config(SEED_YAML).config_hash()


def test_a_model_that_is_not_local_is_refused(tmp_path: Path) -> None:
    data = seed_data()
    data["model"] = "HuggingFaceTB/SmolLM2-135M-Instruct"  # a hub id: would need a download
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert "model" in str(err.value)
    data["model"] = str(tmp_path)
    assert parse_config(data).model == str(tmp_path)


def test_invalid_yaml_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: [unclosed\n", encoding="utf-8")
    with pytest.raises(ConfigError):
        load_config(bad)


def test_missing_or_unreadable_config_file_is_a_config_error_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=r"nope\.yaml: cannot read the config file"):
        load_config(missing)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match=r"binary\.yaml"):
        load_config(binary)


def test_the_retired_bf16_autocast_key_is_refused() -> None:
    data = seed_data()
    data["sft"] = {"bf16_autocast": True}  # the warm start follows training.precision now
    with pytest.raises(ConfigError, match=r"sft\.bf16_autocast"):
        parse_config(data)
