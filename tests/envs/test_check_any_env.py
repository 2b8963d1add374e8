"""``check_env`` on an environment written outside closedloop (the lockbox of tests.envs.lockbox):
its own tools and fork checks run, and every deliberately broken variant is caught by name."""

from __future__ import annotations

import copy
import itertools
import random
from typing import Any

import pytest

from closedloop.contracts import Action, ScoreResult, SnapshotRef
from closedloop.contracts.package import TaskSetRequest
from closedloop.envs import check_actions
from closedloop.envs.check import check_env, check_fork_isolation, check_package, find_probe
from closedloop.envs.check_actions import CheckOptionError, garbage_text, random_actions
from closedloop.errors import (
    EnvCheckError,
    EnvRaisedError,
    EnvVersionMismatchError,
    ForkIsolationError,
    InvalidActionEffectError,
    ProbeNoEffectError,
    ReplayMismatchError,
    ResetNondeterminismError,
    RestoreMismatchError,
    VerifierCheckError,
)
from tests.envs.lockbox import LockboxEnv, LockboxVerifier, lockbox_package, make_package
from tests.envs.terminal.fixtures import JSON_TASK, source

PACKAGE = lockbox_package()
TASKS = list(PACKAGE.task_sets(TaskSetRequest(2, 1, 0)).train)


def test_the_lockbox_passes_with_its_own_tools_and_fork_checks() -> None:
    report = check_package(PACKAGE, seeds=(0, 1), n_random_sequences=3)
    # 2 train + 1 held-out task x 2 seeds: one reset check, 3 sequences, one invalid-text
    # check and one fork check each; package checks: the version + the expert on 3 tasks
    assert (report.resets, report.sequences, report.replays) == (6, 18, 18)
    assert (report.invalid_checks, report.fork_checks, report.package_checks) == (6, 6, 4)
    assert report.sampler_actions > 100 and report.garbage_actions > 0
    assert report.malformed_calls > 0 and report.missing == ()
    assert "6 fork checks" in report.summary()


def test_without_a_probe_a_state_changing_sampler_action_is_found() -> None:
    report = check_env(LockboxEnv, TASKS, [3], 1, sampler=PACKAGE.action_sampler,
                       tool_names=PACKAGE.tool_names)
    assert report.fork_checks == 2 and report.missing == ()
    probe = find_probe(LockboxEnv, TASKS[0], 3, PACKAGE.action_sampler, random.Random(0))
    assert isinstance(probe, Action) and probe.name in ("set", "inspect")  # both change state
    assert find_probe(LockboxEnv, TASKS[0], 3, lambda rng, t: "not an action",
                      random.Random(0)) is None  # unparsable text only bumps the counters


def test_what_an_env_does_not_offer_is_named() -> None:
    bare = make_package(action_sampler=None, fork_probe=None)
    report = check_package(bare, TASKS[:1], seeds=(0,), n_random_sequences=1)
    assert report.sampler_actions == 0 and report.fork_checks == 0
    assert set(report.missing) == {"action_sampler", "fork_probe"}
    assert any("no action sampler" in n for n in report.notes)
    no_fork = check_env(NoForkLock, TASKS[:1], [0], 1, sampler=PACKAGE.action_sampler,
                        probe=PACKAGE.fork_probe)
    assert no_fork.fork_checks == 0 and "fork" in no_fork.missing and no_fork.replays == 1


# -- broken variants: each is caught with its named error ---------------------------------
_counter = itertools.count()


class NoisyResetLock(LockboxEnv):
    """The reset observation carries a process-wide counter."""

    def reset(self, task_id: str, seed: int) -> str:
        return super().reset(task_id, seed) + f" (#{next(_counter)})"


class SharedForkLock(LockboxEnv):
    """fork() hands back the parent itself."""

    def fork(self, snapshot: SnapshotRef, branch_id: str) -> LockboxEnv:
        self.restore(snapshot)
        return self


class SharedSnapshotLock(LockboxEnv):
    """fork() gives the child the stored snapshot's state object itself (no copy)."""

    def fork(self, snapshot: SnapshotRef, branch_id: str) -> LockboxEnv:
        child = type(self)(_store=self.store)
        child.state, child.head = self.stored(snapshot), snapshot.snapshot_id
        return child


class KeepRngRestoreLock(LockboxEnv):
    """restore() keeps the current RNG: the restored state hashes differently."""

    def restore(self, snapshot: SnapshotRef) -> None:
        rng = self.state["rng"] if self.state else None
        super().restore(snapshot)
        if rng is not None and self.state is not None:
            self.state["rng"] = rng


class NoRollbackRestoreLock(LockboxEnv):
    """restore() leaves the state alone but reports the snapshot's hash until the next step."""

    claimed: str | None = None

    def restore(self, snapshot: SnapshotRef) -> None:
        self.stored(snapshot)
        self.claimed = snapshot.state_hash

    def state_hash(self) -> str:
        return self.claimed or super().state_hash()

    def step(self, action: Action | str) -> Any:
        self.claimed = None
        return super().step(action)


class UncapturedRngLock(LockboxEnv):
    """The rattle comes from a ``random.Random`` kept outside the state and the snapshot."""

    def __init__(self, _store: Any = None) -> None:
        super().__init__(_store)
        self.rng = random.Random(0)

    def reset(self, task_id: str, seed: int) -> str:
        self.rng.seed(f"{task_id}/{seed}")
        return super().reset(task_id, seed)

    def rng_value(self, state: dict[str, Any]) -> int:
        return self.rng.randrange(100)

    def fork(self, snapshot: SnapshotRef, branch_id: str) -> LockboxEnv:
        child = super().fork(snapshot, branch_id)
        assert isinstance(child, UncapturedRngLock)
        child.rng = copy.deepcopy(self.rng)
        return child


class TextEffectLock(LockboxEnv):
    """Unparsable text jiggles dial 0 by its length."""

    def apply(self, state: dict[str, Any], action: Action | str) -> tuple[str, str | None]:
        if isinstance(action, str):
            observation, error = super().apply(state, action)
            if error == "invalid_action":
                state["dials"][0] = len(action) % 10
            return observation, error
        return super().apply(state, action)


class LockJammed(Exception):
    """The lock's own error type."""


class RaisingLock(LockboxEnv):
    """inspect of a dial that does not exist raises the env's own exception."""

    def tool(self, state: dict[str, Any], action: Action) -> tuple[str, str | None]:
        if action.name == "inspect" and action.args.get("i") not in (0, 1, 2):
            raise LockJammed(f"dial {action.args.get('i')!r} jammed")
        return super().tool(state, action)


class NoForkLock(LockboxEnv):
    """An env that cannot fork."""

    def fork(self, snapshot: SnapshotRef, branch_id: str) -> LockboxEnv:
        raise NotImplementedError("no forks here")


@pytest.mark.parametrize(("env_cls", "error"), [
    (NoisyResetLock, ResetNondeterminismError),
    (SharedForkLock, ForkIsolationError),
    (SharedSnapshotLock, ForkIsolationError),
    (KeepRngRestoreLock, RestoreMismatchError),
    (NoRollbackRestoreLock, ReplayMismatchError),
    (UncapturedRngLock, ReplayMismatchError),
    (TextEffectLock, InvalidActionEffectError),
    (RaisingLock, EnvRaisedError),
])
def test_every_broken_lockbox_is_caught(env_cls: type[LockboxEnv],
                                        error: type[EnvCheckError]) -> None:
    with pytest.raises(error) as info:
        check_package(make_package(env_cls), TASKS, seeds=(4,), n_random_sequences=3)
    assert type(info.value) is error  # the named error itself, not a neighbour
    assert "seed 4 step" in str(info.value) and "lockbox-dials-v1/" in str(info.value)
    if error is EnvRaisedError:
        assert "LockJammed" in str(info.value)


def test_each_break_passes_once_repaired() -> None:
    """Power check: the same run on the unbroken lock passes (the breaks, not the checker,
    make the cases above fail)."""
    report = check_package(make_package(), TASKS, seeds=(4,), n_random_sequences=3)
    assert report.fork_checks == 2 and report.invalid_checks == 2


class WrongVersionLock(LockboxEnv):
    env_version = "lockbox-env-v0"


class AcceptAll(LockboxVerifier):
    def score_or_quarantine(self, task_id: str, final_state: bytes) -> ScoreResult:
        return ScoreResult.of(task_id, 1.0, self.verifier_version)


class RejectAll(LockboxVerifier):
    def score_or_quarantine(self, task_id: str, final_state: bytes) -> ScoreResult:
        return ScoreResult.of(task_id, 0.0, self.verifier_version)


@pytest.mark.parametrize(("changes", "error", "words"), [
    ({"make_env": WrongVersionLock}, EnvVersionMismatchError, "lockbox-env-v0"),
    ({"make_verifier": AcceptAll}, VerifierCheckError, "untouched reset state"),
    ({"make_verifier": RejectAll}, VerifierCheckError, "expert's final state 0.0"),
])
def test_package_checks(changes: dict[str, Any], error: type[EnvCheckError],
                        words: str) -> None:
    with pytest.raises(error, match=words):
        check_package(make_package(**changes), TASKS[:1], seeds=(0,), n_random_sequences=1)


# -- options are checked, never an IndexError ---------------------------------------------
def test_unknown_weights_are_named_errors() -> None:
    with pytest.raises(CheckOptionError, match="'inspect'"):
        random_actions(random.Random(0), source(JSON_TASK), 3, {"inspect": 1})
    with pytest.raises(CheckOptionError, match="'inspect'"):
        check_env(LockboxEnv, TASKS, [0], sampler=PACKAGE.action_sampler, mix={"inspect": 1})
    with pytest.raises(CheckOptionError, match="weights apply to the terminal"):
        check_env(LockboxEnv, TASKS, [0], sampler=PACKAGE.action_sampler,
                  weights={"read_file": 1})
    with pytest.raises(CheckOptionError, match="must be a finite number"):
        check_env(LockboxEnv, TASKS, [0], sampler=PACKAGE.action_sampler,
                  mix={"garbage": -1})
    with pytest.raises(CheckOptionError, match="every source has weight 0"):
        check_env(LockboxEnv, TASKS, [0], mix={"garbage": 0, "malformed": 0, "finish": 0})


def test_garbage_never_parses_and_malformed_calls_break_real_arguments() -> None:
    from closedloop.contracts import ActionParseError, parse_action

    rng = random.Random(7)
    for _ in range(300):
        with pytest.raises(ActionParseError):
            parse_action(garbage_text(rng))
    example = {"set": Action.tool("set", i=1, v=2)}
    calls = [check_actions.malformed_call(rng, ["set", "finish"], example) for _ in range(200)]
    assert all(c.name == "set" or c.name.startswith("no_such_tool") for c in calls)
    assert all(c.canonical_json() != example["set"].canonical_json() for c in calls)
    assert any(set(c.args) == {"i"} or set(c.args) == {"v"} for c in calls)  # a key dropped


class DialsOnlyHashLock(LockboxEnv):
    """The state hash covers the dials only (inspect changes nothing it hashes)."""

    def state_hash(self) -> str:
        from closedloop.contracts import content_hash

        return content_hash(self.state["dials"] if self.state else None)


def test_a_probe_that_changes_nothing_is_named() -> None:
    with pytest.raises(ProbeNoEffectError, match="did not change fork A's state"):
        check_fork_isolation(DialsOnlyHashLock, TASKS[0], 0, [],
                             Action.tool("inspect", i=0))
    check_fork_isolation(DialsOnlyHashLock, TASKS[0], 0, [], Action.tool("set", i=1, v=9))
