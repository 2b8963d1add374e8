"""check_env and the replay property on the fixtures, and the checker catching broken envs."""

import dataclasses
import itertools
import random

import pytest

from closedloop.contracts import Action, ActionParseError, parse_action
from closedloop.envs import (
    ForkIsolationError,
    ReplayMismatchError,
    ResetNondeterminismError,
    StepNondeterminismError,
    check_env,
    random_actions,
    replay_property,
)
from closedloop.envs.terminal import TerminalRepairEnv
from closedloop.envs.terminal.workspace import initial_rng_state, rng_state_hash
from tests.envs.terminal.fixtures import (
    CLI_LONG,
    CLI_TASK,
    FAST_SANDBOX,
    JSON_TASK,
    READONLY_TASK,
    EnvConfig,
    make_env,
    source,
)

NO_RUN = {"run": 0.0}


def test_check_env_passes_on_the_fixtures():
    report = check_env(make_env, [JSON_TASK, CLI_TASK, READONLY_TASK], seeds=[0, 1],
                       n_random_sequences=2, sequence_length=8, rng_seed=3)
    # the read-only task has no write_file probe: its fork checks use a sampler action
    assert (report.resets, report.sequences, report.replays, report.fork_checks) == (6, 12, 12, 6)
    assert report.missing == ()
    assert report.steps > 12


def test_a_task_without_the_declared_probe_gets_a_state_changing_sampler_action():
    # spec_of= on tasks without write_file: the write_file probe has no action for them, and
    # the search goes on in the env's own sampler instead of giving up (0 fork checks)
    report = check_env(make_env, [READONLY_TASK], seeds=[0, 1], n_random_sequences=1,
                       sequence_length=4, spec_of=source)
    assert report.fork_checks == 2 and "fork_probe" not in report.missing
    never = check_env(make_env, [READONLY_TASK], seeds=[0], n_random_sequences=1,
                      sequence_length=4, sampler=lambda rng, task_id: "no action at all")
    assert never.fork_checks == 0 and "fork_probe" in never.missing  # none exists: named


def test_replay_property_over_200_random_sequences():
    played = 0
    for i in range(200):
        rng = random.Random(i)
        actions = random_actions(rng, source(JSON_TASK), rng.randint(1, 14), NO_RUN)
        played += replay_property(make_env, JSON_TASK, seed=i % 5, actions=actions,
                                  snapshot_at=rng.randrange(15))
    assert played > 1000


def test_replay_property_with_real_commands():
    commands = 0
    for i in range(12):
        rng = random.Random(1000 + i)
        actions = random_actions(rng, source(CLI_LONG), 10, {"run": 3.0, "finish": 0.0})
        commands += sum(1 for a in actions if "run" in str(a))
        replay_property(make_env, CLI_LONG, seed=i, actions=actions, snapshot_at=rng.randrange(10))
    assert commands >= 12


def test_random_actions_mix_every_kind():
    actions = random_actions(random.Random(0), source(CLI_TASK), 1500)
    tools = {_parsed(a).name for a in actions if _parsed(a) is not None}
    assert tools >= {"read_file", "list_dir", "write_file", "replace", "run", "finish",
                     "abstain", "delete_everything"}
    assert any(isinstance(a, str) and a.startswith("<tool_call>{") for a in actions)
    assert any(isinstance(a, str) and "<tool_call>" not in a for a in actions)
    assert random_actions(random.Random(5), source(CLI_TASK), 30) == \
        random_actions(random.Random(5), source(CLI_TASK), 30)
    ro = random_actions(random.Random(0), source(READONLY_TASK), 200)
    assert not any(isinstance(a, Action) and a.name == "run" for a in ro)


def _parsed(action):
    if isinstance(action, Action):
        return action
    try:
        return parse_action(action)
    except ActionParseError:
        return None


def test_check_env_with_many_commands():
    report = check_env(make_env, [CLI_TASK], seeds=[2], n_random_sequences=2,
                       sequence_length=6, weights={"run": 4.0, "finish": 0.0},
                       mix={"finish": 0.0})
    assert report.steps == 12


# -- the checker must fail on environments that break the contract ---------------------------


class NoisyResetEnv(TerminalRepairEnv):
    def reset(self, task_id, seed):
        self.resets = getattr(self, "resets", 0) + 1
        return super().reset(task_id, seed) + f"\n(reset #{self.resets})"


_global_counter = itertools.count()


class NoisyStepEnv(TerminalRepairEnv):
    def step(self, action):
        t = super().step(action)
        return dataclasses.replace(t, observation=t.observation + f" #{next(_global_counter)}")


class ClockKeepingRestoreEnv(TerminalRepairEnv):
    """Restores files but keeps the current step counter and clock."""

    def restore(self, snapshot):
        current = self._state
        super().restore(snapshot)
        if current is not None:
            self._state = dataclasses.replace(self._state, steps=current.steps,
                                              clock=current.clock)


class SharedForkEnv(TerminalRepairEnv):
    """fork() hands back the parent itself."""

    def fork(self, snapshot, branch_id):
        self.restore(snapshot)
        return self


class BranchSeededForkEnv(TerminalRepairEnv):
    """fork() reseeds the RNG from the branch id."""

    def fork(self, snapshot, branch_id):
        child = super().fork(snapshot, branch_id)
        rng = initial_rng_state(branch_id, 0)
        child._state = dataclasses.replace(child._state, rng_state=rng,
                                           rng_hash=rng_state_hash(rng))
        return child


@pytest.mark.parametrize("cls,error", [
    (NoisyResetEnv, ResetNondeterminismError),
    (NoisyStepEnv, StepNondeterminismError),
    (ClockKeepingRestoreEnv, ReplayMismatchError),
    (SharedForkEnv, ForkIsolationError),
    (BranchSeededForkEnv, ForkIsolationError),
])
def test_check_env_catches_broken_envs(cls, error):
    def factory():
        return cls(source, EnvConfig(sandbox=FAST_SANDBOX))

    with pytest.raises(error) as info:
        check_env(factory, [JSON_TASK], seeds=[4], n_random_sequences=2, sequence_length=6,
                  weights=NO_RUN)
    assert f"task {JSON_TASK!r} seed 4 step" in str(info.value)
