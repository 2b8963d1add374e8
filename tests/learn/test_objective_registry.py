"""The objective registry users extend: ``register_objective(name, factory)`` and dotted paths
in ``update.objective``, checked against the ``Objective`` protocol when the config loads; a
user objective defined outside closedloop (``tests.learn.user_objective``) trains one step
through ``closedloop train`` on the tiny agent, and the gates re-run it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

from closedloop.cli import main
from closedloop.config import parse_config
from closedloop.contracts import ConfigError
from closedloop.contracts.update import Objective, ObjectiveInputs
from closedloop.errors import InvalidObjectiveError, UnknownObjectiveError
from closedloop.learn.objectives import (
    OBJECTIVES,
    ClipRange,
    get_objective,
    register_objective,
    reinforce_with_kl,
)
from closedloop.learn.objectives import registry as registry_module
from closedloop.policy.registry import PolicyRegistry
from tests.conftest import short_run_config
from tests.learn import user_objective
from tests.test_config_keys import seed_with

SIGN = "tests.learn.user_objective:sign_reinforce"


@pytest.fixture
def registry() -> Iterator[None]:
    """Registrations made by a test are undone after it."""
    before = dict(OBJECTIVES)
    yield
    registry_module._REGISTRY.clear()
    registry_module._REGISTRY.update(before)


def _inputs() -> ObjectiveInputs:
    new = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]], requires_grad=True)
    return ObjectiveInputs(new_logprobs_B_T=new, behavior_logprobs_B_T=new.detach(),
                           advantages_B=torch.tensor([0.25, -4.0]),
                           mask_B_T=torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]))


def test_a_dotted_path_names_a_user_objective_checked_against_the_protocol() -> None:
    objective = get_objective(SIGN)
    assert isinstance(objective, Objective)
    assert (objective.name, objective.uses_ratio) == ("sign_reinforce", False)
    out = objective(_inputs())
    out.loss.backward()
    assert out.objective == "sign_reinforce"
    # episode_sum: ∂L/∂log πθ = -sign(A_i)/B on the mask, whatever |A_i|
    assert out.grad_coef_B_T.tolist() == [[-0.5, -0.5, 0.0], [0.5, 0.5, 0.5]]
    assert get_objective("tests.learn.user_objective:sign_ppo", ClipRange(0.3)).eps == 0.3


@pytest.mark.parametrize(("spec", "error", "match"), [
    ("sign_reinforce", UnknownObjectiveError, "known: .*reinforce_with_kl"),
    ("tests.learn.no_such_module:f", UnknownObjectiveError, "cannot import"),
    ("tests.learn.user_objective:missing", UnknownObjectiveError, "has no 'missing'"),
    ("not a path:f", UnknownObjectiveError, "not a dotted path"),
    ("tests.learn.user_objective:NOT_A_FACTORY", InvalidObjectiveError, "not a factory"),
    ("tests.learn.user_objective:not_an_objective", InvalidObjectiveError, "protocol"),
])
def test_what_does_not_resolve_to_an_objective_is_refused(spec: str, error: type[Exception],
                                                          match: str) -> None:
    with pytest.raises(error, match=match):
        get_objective(spec)


def test_register_objective_adds_a_name_the_config_accepts(registry: None) -> None:
    with pytest.raises(ConfigError, match=r"update\.objective"):
        parse_config(seed_with("update.objective", "sign_reinforce"))
    register_objective("sign_reinforce", user_objective.sign_reinforce)
    assert "sign_reinforce" in OBJECTIVES
    cfg = parse_config(seed_with("update.objective", "sign_reinforce"))
    assert get_objective(cfg.update.objective).name == "sign_reinforce"
    with pytest.raises(InvalidObjectiveError, match="already registered"):
        register_objective("sign_reinforce", user_objective.sign_ppo)
    register_objective("sign_reinforce", user_objective.sign_ppo, replace=True)
    with pytest.raises(InvalidObjectiveError, match="names itself 'sign_ppo'"):
        get_objective("sign_reinforce")  # outputs would carry another name than the config's
    for bad in ("", "a:b"):
        with pytest.raises(InvalidObjectiveError):
            register_objective(bad, user_objective.sign_reinforce)
    with pytest.raises(InvalidObjectiveError, match="not callable"):
        register_objective("three", 3)  # type: ignore[arg-type]


def test_the_builtins_are_registered_factories() -> None:
    assert get_objective("reinforce_with_kl").fn is reinforce_with_kl  # type: ignore[attr-defined]
    assert sorted(OBJECTIVES) == ["normalized_ratio_clip[sequence]", "normalized_ratio_clip[turn]",
                                  "ppo_clip", "reinforce_with_kl"]


@pytest.mark.parametrize(("key", "value", "extra", "named"), [
    ("update.objective", "ppo", {}, "update.objective"),
    ("update.objective", "tests.learn.user_objective:not_an_objective", {}, "update.objective"),
    ("update.objective", SIGN, {"update__optimizer_steps_per_fresh_batch": 2},
     "update.optimizer_steps_per_fresh_batch"),
    ("update.objective", SIGN, {"rollout__top_p": 0.9}, "rollout.top_p"),
    ("update.clip_eps", 1.5, {}, "update.clip_eps"),
])
def test_config_load_refuses_an_objective_naming_the_key(key: str, value: object,
                                                         extra: dict[str, object],
                                                         named: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(seed_with(key, value, **extra))
    assert err.value.key == named


def test_whether_a_batch_may_be_reused_comes_from_the_objective_itself() -> None:
    cfg = parse_config(seed_with("update.objective", "tests.learn.user_objective:sign_ppo",
                                 update__optimizer_steps_per_fresh_batch=2))
    assert cfg.update.optimizer_steps_per_fresh_batch == 2


def test_a_user_objective_trains_one_step_through_closedloop_train(
        tiny_agent_dir: Path, tmp_path: Path) -> None:
    data = short_run_config(tiny_agent_dir, 1)
    data["update"] = {"objective": SIGN}
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(data))
    user_objective.CALLS.clear()
    run = tmp_path / "run"
    assert main(["train", str(config), "--run-dir", str(run), "--json"]) == 0
    assert json.loads((run / "trainer.json").read_text())["objective"] == SIGN
    reg = PolicyRegistry(run / "registry")
    assert reg.versions()[-1] == "v0001"
    assert reg.manifest("v0001").weight_checksum != reg.manifest("v0000").weight_checksum
    gates = {g["name"]: g for g in json.loads((run / "report.json").read_text())["gates"]["gates"]}
    # the gates re-run the run's objective from its path: ratio-free, so its ratios are checked
    assert gates["episode_sum_score_function"]["evidence"]["objective"] == SIGN
    # the trainer's micro-batches, then the gate's re-run on the step's recorded batch
    assert len(user_objective.CALLS) >= 2
    assert user_objective.CALLS[-1] == gates["episode_sum_score_function"]["evidence"]["episodes"]
    assert gates["ratio_on_policy"]["evidence"]["objective"] == SIGN
    assert gates["ratio_on_policy"]["status"] == "PASS", gates["ratio_on_policy"]
    assert gates["episode_sum_score_function"]["status"] == "PASS"  # sign(±1) = ±1
