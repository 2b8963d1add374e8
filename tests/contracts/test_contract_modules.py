"""The three contract modules hold what the project implements: every built-in environment is an
``AgentEnv``, every built-in verifier a ``TaskVerifier`` (guarded or not), every
registered objective an ``Objective``, the trainer a ``PolicyUpdater``; and the contracts layer
imports no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from closedloop.contracts import (
    AgentEnv,
    GuardedVerifier,
    Objective,
    PolicyUpdater,
    TaskVerifier,
)
from closedloop.envs.discovery import BUILTIN, resolve_package
from closedloop.learn.objectives import OBJECTIVES, get_objective
from closedloop.learn.trainer import Trainer, TrainerConfig


@pytest.mark.parametrize("env_id", sorted(BUILTIN))
def test_every_built_in_env_satisfies_the_transition_contract(env_id: str) -> None:
    package = resolve_package(env_id)
    env = package.make_env()
    assert isinstance(env, AgentEnv)
    assert env.env_version == package.env_version


def test_the_built_in_packages_were_all_checked() -> None:
    assert len(BUILTIN) == 5  # terminal-repair, keydoor, shopping, searchqa, frozenlake


@pytest.mark.parametrize("env_id", sorted(BUILTIN))
def test_every_built_in_verifier_satisfies_the_verification_contract(env_id: str) -> None:
    package = resolve_package(env_id)
    verifier = package.make_verifier()
    assert isinstance(verifier, TaskVerifier) and not isinstance(verifier, GuardedVerifier)
    guarded = package.verifier()
    assert isinstance(guarded, GuardedVerifier) and isinstance(guarded, TaskVerifier)
    assert guarded.verifier_version == verifier.verifier_version


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_every_registered_objective_satisfies_the_update_contract(name: str) -> None:
    objective = get_objective(name)
    assert isinstance(objective, Objective)
    assert objective.name == name and objective.uses_ratio is (name != "reinforce_with_kl")


def test_the_trainer_satisfies_the_policy_updater_protocol() -> None:
    trainer = Trainer(torch.nn.Linear(2, 2), TrainerConfig())
    updater: PolicyUpdater = trainer
    assert isinstance(updater, PolicyUpdater) and updater.step_count == 0
    assert isinstance(trainer.objective, Objective)


def test_the_protocol_checks_can_fail() -> None:
    class NoFork:
        env_version = "x"

        def reset(self, task_id: str, seed: int) -> str:
            return ""

    assert not isinstance(NoFork(), AgentEnv)
    assert not isinstance(object(), TaskVerifier)
    assert not isinstance(lambda inputs: inputs, Objective)
    assert not isinstance(torch.nn.Linear(2, 2), PolicyUpdater)


def test_importing_the_contracts_imports_no_torch() -> None:
    code = ("import sys, closedloop.contracts\n"
            "assert 'torch' not in sys.modules, 'closedloop.contracts imported torch'\n"
            "import closedloop.contracts.update, closedloop.contracts.verification\n"
            "import closedloop.contracts.transition\n"
            "assert 'torch' not in sys.modules\n"
            "assert not any(m.startswith(('closedloop.learn', 'closedloop.rollout',\n"
            "                             'closedloop.envs', 'closedloop.envs.terminal'))\n"
            "               for m in sys.modules), 'a contract module imported a higher layer'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stderr
