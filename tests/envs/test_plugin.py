"""The plug-in contract: package records, the registry (built-ins, dotted paths, entry points),
the config keys that name a package, the task-set request, and the verifier protocol."""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from closedloop.config import parse_config, task_set_request
from closedloop.contracts import ConfigError, ContractError, ScoreResult, guarded
from closedloop.contracts.package import EnvTaskSets, TaskSetRequest
from closedloop.envs.discovery import (
    DEFAULT_ENV_ID,
    ENTRY_POINT_GROUP,
    EnvPackageError,
    UnknownEnvironmentError,
    load_dotted,
    package_for_version,
    registered,
    resolve_package,
    resolve_section,
)
from closedloop.envs.terminal.package import terminal_package
from closedloop.errors import SandboxInfraError, StateDecodeError, TamperDetected, VerifierFailure
from closedloop.training.wiring import run_package
from tests.envs.lockbox import ENV_ID, ENV_VERSION, LockboxVerifier, lockbox_package

FACTORY = "tests.envs.lockbox:lockbox_package"


@pytest.fixture(autouse=True)
def _fresh_registry() -> Iterator[None]:
    resolve_package.cache_clear()
    yield
    resolve_package.cache_clear()


# -- registry ------------------------------------------------------------------------------
def test_the_terminal_tasks_are_the_builtin_default() -> None:
    package = resolve_package()
    assert package is terminal_package() and package.env_id == DEFAULT_ENV_ID
    assert resolve_package("deterministic_terminal") is package  # the config's domain alias
    assert resolve_section({"domain": "deterministic_terminal"}) is package
    assert package.missing() == ()  # it offers every optional part
    assert "finish" in package.tool_names and package.config_keys


def test_a_dotted_path_loads_a_package_or_its_factory() -> None:
    assert load_dotted(FACTORY).env_id == ENV_ID
    assert load_dotted("tests.envs.lockbox:make_package").env_id == ENV_ID  # a factory
    assert resolve_package(ENV_ID, FACTORY).env_version == ENV_VERSION
    assert resolve_section({"factory": FACTORY, "domain": "deterministic_terminal"}).env_id \
        == ENV_ID  # a factory without an id is not checked against the default domain


@pytest.mark.parametrize(("path", "words"), [
    ("tests.envs.lockbox", "not a dotted path"),
    ("tests.envs.no_such_module:x", "cannot import"),
    ("tests.envs.lockbox:no_such_attr", "has no 'no_such_attr'"),
    ("tests.envs.lockbox:ENV_ID", "neither an EnvPackage"),
    ("tests.envs.lockbox:task_code", "calling it raised TypeError"),  # not a factory
])
def test_bad_dotted_paths_are_named(path: str, words: str) -> None:
    with pytest.raises(EnvPackageError, match=words):
        load_dotted(path)


def test_an_id_must_match_the_package_found() -> None:
    with pytest.raises(EnvPackageError, match="holds environment 'lockbox-v1', not 'other-v1'"):
        resolve_package("other-v1", FACTORY)
    with pytest.raises(UnknownEnvironmentError, match="no environment package 'nope-v1'"):
        resolve_package("nope-v1")


def test_entry_points_register_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dist = tmp_path / "lockbox_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: lockbox-plugin\n"
                                   "Version: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{ENV_ID} = {FACTORY}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert registered()[ENV_ID] == f"entry point:{FACTORY}"
    assert resolve_package(ENV_ID).env_id == ENV_ID
    assert resolve_section({"id": ENV_ID}).env_version == ENV_VERSION
    found = package_for_version(ENV_VERSION)
    assert found is not None and found.env_id == ENV_ID
    assert str(tmp_path) in sys.path


def test_package_records_are_validated() -> None:
    good = lockbox_package()
    for change, words in [({"env_id": "lockbox"}, "versioned id"),
                          ({"env_version": ""}, "env_version"),
                          ({"make_env": None}, "make_env must be callable"),
                          ({"tool_schemas": ()}, "non-empty tuple"),
                          ({"tool_schemas": ({"description": "x"},)}, "with a 'name'"),
                          ({"system_prompt": " "}, "system_prompt"),
                          ({"scripted": {"oracle": lambda *a: None}}, "unknown kinds"),
                          ({"fork_probe": 3}, "fork_probe must be callable")]:
        with pytest.raises(EnvPackageError, match=words):
            dataclasses.replace(good, **change)
    with pytest.raises(EnvPackageError, match="offers no 'expert'"):
        dataclasses.replace(good, scripted={}).scripted_policy("expert", "t", 0)


def test_task_sets_are_disjoint_tuples() -> None:
    with pytest.raises(EnvPackageError, match="in both train and heldout"):
        EnvTaskSets(("a", "b"), ("b",))
    with pytest.raises(EnvPackageError, match="in both train and family"):
        EnvTaskSets(("a",), ("b",), suites={"family": ("a",)})
    with pytest.raises(EnvPackageError, match="repeats"):
        EnvTaskSets(("a", "a"), ())
    with pytest.raises(EnvPackageError, match="tuple of task id strings"):
        EnvTaskSets(["a"], ())  # type: ignore[arg-type]


# -- config keys ---------------------------------------------------------------------------
def test_environment_id_and_factory_config_keys() -> None:
    cfg = parse_config({"environment": {"id": ENV_ID, "factory": FACTORY}})
    assert run_package(cfg.environment).env_id == ENV_ID
    assert run_package(parse_config({}).environment).env_id == DEFAULT_ENV_ID
    assert run_package(parse_config({"environment": {"id": "deterministic_terminal"}})
                       .environment).env_id == DEFAULT_ENV_ID
    with pytest.raises(ConfigError, match=re.escape("environment.id")):
        parse_config({"environment": {"id": "Lockbox"}})
    with pytest.raises(ConfigError, match=re.escape("environment.factory")):
        parse_config({"environment": {"factory": "tests/envs/lockbox.py"}})


def test_environment_options_reach_the_package_which_checks_them() -> None:
    lock = lockbox_package()
    cfg = parse_config({"environment": {"id": ENV_ID, "factory": FACTORY, "train_tasks": 3,
                                        "heldout_tasks": 2, "task_seed": 5},
                        "evaluation": {"environment_family_disjoint": False}})
    request = task_set_request(cfg, lock)
    assert request == TaskSetRequest(3, 2, seed=5, family_tasks=0, options={})
    sets = lock.task_sets(request)
    assert (len(sets.train), len(sets.heldout)) == (3, 2)
    with pytest.raises(EnvPackageError, match="lockbox takes no options"):
        lock.task_sets(dataclasses.replace(request, options={"x": 1}))
    # the default (terminal) package checks its options when the config is loaded
    with pytest.raises(ConfigError, match=re.escape("environment.options.x")):
        parse_config({"environment": {"options": {"x": 1}}})
    with pytest.raises(ConfigError, match=re.escape("environment.train_levels")):
        parse_config({"environment": {"train_levels": ["exact", "bogus"]}})
    with pytest.raises(ConfigError, match=re.escape("environment.train_levels")):  # a terminal key
        task_set_request(parse_config({"environment": {"train_levels": ["exact"]}}), lock)
    terminal = terminal_package()
    request = task_set_request(parse_config({"environment": {"train_levels": ["exact"]}}),
                               terminal)
    assert request.options["train_levels"] == ["exact"] and request.family_tasks == 8
    with pytest.raises(EnvPackageError, match=r"\['bogus'\]: not options"):
        terminal.task_sets(dataclasses.replace(request, options={"bogus": 1}))
    with pytest.raises(ConfigError, match=re.escape("environment.options.train_levels")):
        task_set_request(parse_config(
            {"environment": {"options": {"train_levels": ["exact"]}}}), terminal)


# -- the verifier protocol -----------------------------------------------------------------
def test_score_results_are_validated() -> None:
    ok = ScoreResult.of("t", 1.0, "v1", {"steps": 3})
    assert ok.success == 1.0 and ok.reward == {"task_success": 1.0, "steps": 3.0}
    assert ScoreResult.unscored("t", "tamper_detected: x", "v1").success is None
    for kwargs, words in [({"reward": None, "quarantine_reason": None}, "exactly one"),
                          ({"reward": {"task_success": 1.0}, "quarantine_reason": "x"},
                           "exactly one"),
                          ({"reward": {"steps": 1.0}}, "no 'task_success'"),
                          ({"reward": {"task_success": 1.5}}, "outside"),
                          ({"reward": {"task_success": math.nan}}, "finite"),
                          ({"reward": {"task_success": True}}, "finite"),
                          ({"verifier_version": ""}, "verifier_version")]:
        fields: dict[str, Any] = {"task_id": "t", "reward": {"task_success": 0.0},
                                  "quarantine_reason": None, "verifier_version": "v1", **kwargs}
        with pytest.raises(ContractError, match=words):
            ScoreResult(**fields)


class _Raising(LockboxVerifier):
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def score_or_quarantine(self, task_id: str, final_state: bytes) -> ScoreResult:
        raise self.exc


class _OutOfRange(LockboxVerifier):
    def score_or_quarantine(self, task_id: str, final_state: bytes) -> ScoreResult:
        return ScoreResult.of(task_id, 2.0, self.verifier_version)


class _WrongType(LockboxVerifier):
    def score_or_quarantine(self, task_id: str, final_state: bytes) -> Any:
        return {"task_success": 1.0}


class _OtherTask(LockboxVerifier):
    def score_or_quarantine(self, task_id: str, final_state: bytes) -> ScoreResult:
        return ScoreResult.of("other", 1.0, self.verifier_version)


@pytest.mark.parametrize(("verifier", "words"), [
    (_Raising(VerifierFailure("grader timed out")), "verifier_failure: VerifierFailure: grader"),
    (_Raising(SandboxInfraError("no tmp")), "verifier_failure: SandboxInfraError"),
    (_Raising(TimeoutError("slow")), "verifier_failure: TimeoutError"),
    (_Raising(TamperDetected("check.py changed")), "tamper_detected: TamperDetected"),
    (_Raising(StateDecodeError("not json")), "invalid_state: StateDecodeError"),
])
def test_a_guarded_verifier_leaves_declared_failures_unscored(verifier: Any, words: str) -> None:
    result = guarded(verifier).score_or_quarantine("t", b"{}")
    assert result.reward is None and words in (result.quarantine_reason or "")
    assert result.verifier_version == verifier.verifier_version
    assert guarded(guarded(verifier)) == guarded(verifier)  # idempotent


@pytest.mark.parametrize(("verifier", "kind", "words"), [
    (_Raising(TypeError("unsupported operand")), TypeError, "unsupported operand"),
    (_Raising(KeyError("dials")), KeyError, "dials"),
    (_OutOfRange(), ContractError, "outside"),
    (_WrongType(), ContractError, "returned dict, not a ScoreResult"),
    (_OtherTask(), ContractError, "asked for 't', scored 'other'"),
])
def test_a_programming_error_in_a_verifier_propagates(verifier: Any, kind: type,
                                                      words: str) -> None:
    with pytest.raises(kind, match=words) as info:
        guarded(verifier).score_or_quarantine("t", b"{}")
    if kind is not ContractError or "outside" in words:  # raised inside: a note names it
        assert "scoring task 't'" in "".join(getattr(info.value, "__notes__", []))
