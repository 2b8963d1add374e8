"""The package check (closedloop.evaluate.package_check): ``closedloop check PACKAGE`` on any
package, and ``closedloop train`` stopping before it writes anything when the check fails. The
lockbox of tests.envs.lockbox plays a package written outside closedloop."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from closedloop.cli import main
from closedloop.config import parse_config
from closedloop.contracts import ScoreResult
from closedloop.contracts.package import EnvPackage
from closedloop.errors import PackageCheckError
from closedloop.evaluate.package_check import (
    PACKAGE_CHECK_FILE,
    check_before_training,
    check_environment_package,
)
from closedloop.training.loop import train
from tests.envs.lockbox import ENV_ID, LockboxEnv, LockboxVerifier, lockbox_package, make_package

HERE = "tests.evaluate.test_package_check"


class SloppyVerifier(LockboxVerifier):
    """Reads two dials of three: accepts the expert, rejects the reset state, and accepts a
    lock whose third dial is wrong (a false positive only the fixtures show)."""

    def score_or_quarantine(self, task_id: str, final_state: bytes) -> ScoreResult:
        state = json.loads(final_state)
        if state.get("task_id") != task_id:
            return ScoreResult.unscored(task_id, "tamper_detected: another task",
                                        self.verifier_version)
        from tests.envs.lockbox import task_code
        ok = list(state["dials"][:2]) == list(task_code(task_id)[:2]) and \
            state.get("final_action") == "finish"
        return ScoreResult.of(task_id, 1.0 if ok else 0.0, self.verifier_version)


class ForgetfulLock(LockboxEnv):
    """Restoring a snapshot forgets the dials (a replay does not reproduce)."""

    def restore(self, ref: Any) -> None:
        super().restore(ref)
        if self.state is not None:
            self.state["dials"] = [0, 0, 0]


def sloppy_package() -> EnvPackage:
    return make_package(make_verifier=SloppyVerifier)


def forgetful_package() -> EnvPackage:
    return make_package(ForgetfulLock)


def test_check_passes_a_sound_package_from_its_factory(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "tests.envs.lockbox:lockbox_package", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["passed"] and data["mode"] == "full" and data["env_id"] == ENV_ID
    assert data["environment"]["fork_checks"] > 0 and data["environment"]["package_checks"] > 0
    assert data["verifier"]["n_negative"] > 0 and data["verifier"]["fp"] == 0


@pytest.mark.parametrize(("factory", "words"), [
    ("sloppy_package", "verifier: FP"),
    ("forgetful_package", "environment: "),
])
def test_check_fails_a_package_whose_verifier_or_env_is_wrong(
        factory: str, words: str, capsys: pytest.CaptureFixture[str]) -> None:
    for quick in ([], ["--quick"]):
        assert main(["check", f"{HERE}:{factory}", *quick]) == 1
        out = capsys.readouterr().out
        assert "FAILED" in out and f"FAIL {words}" in out


def test_the_quick_check_allows_no_disagreement_and_the_full_one_its_bounds() -> None:
    quick = check_environment_package(sloppy_package(), "quick")
    assert not quick.passed and quick.verifier is not None
    assert quick.verifier["rule"] == "no disagreement" and quick.verifier["fp"] > 0
    full = check_environment_package(sloppy_package(), "full")
    assert any("upper CI" in p for p in full.problems)
    off = check_environment_package(lockbox_package(), "off")
    assert off.passed and off.environment is None and "off" in off.notes[0]


def test_train_stops_on_a_failed_check_before_writing_anything(tmp_path: Path) -> None:
    cfg = parse_config({"environment": {"id": ENV_ID, "factory": f"{HERE}:sloppy_package",
                                        "train_tasks": 2, "heldout_tasks": 1},
                        "evaluation": {"retain_suites": [],
                                       "environment_family_disjoint": False},
                        "training": {"package_check": "quick"}})
    run_dir = tmp_path / "run"
    with pytest.raises(PackageCheckError, match="FP") as info:
        train(cfg, run_dir)
    assert info.value.env_id == ENV_ID
    assert not run_dir.exists() or not any(run_dir.iterdir())  # a fixed relaunch starts clean


def test_a_recorded_check_is_not_run_again(tmp_path: Path) -> None:
    (tmp_path / PACKAGE_CHECK_FILE).write_text("{}")
    assert check_before_training(sloppy_package(), "full", tmp_path) is None
    assert check_before_training(lockbox_package(), "quick", tmp_path / "new") is not None
