"""SimEnv, SimState and TaskCatalog: the machinery under key-and-door, shopping and SearchQA."""

import dataclasses
import json

import pytest

from closedloop.contracts import Action, SnapshotMismatchError, Termination
from closedloop.contracts.package import Opening, Outcome, TaskSetRequest
from closedloop.envs.discovery import EnvPackageError
from closedloop.envs.sim import SimEnv, decode_sim_state
from closedloop.envs.sim.env import SnapshotUnsupportedError
from closedloop.envs.sim.package import catalog_task_sets, draw_task_ids
from closedloop.envs.sim.state import SimState
from closedloop.errors import (
    EnvNotResetError,
    EpisodeDoneError,
    SealedSnapshotError,
    StateDecodeError,
    TaskError,
)


class Counter:
    """Rules of a counter: ``add(n)`` adds n (costs n units), ``stop`` ends the episode."""

    env_version = "counter-v1"
    snapshot_refusal = None

    def opening(self, task_id: str, seed: int) -> Opening:
        if task_id != "count":
            raise TaskError(f"unknown task {task_id!r}")
        return Opening({"n": seed}, 10, f"start at {seed}")

    def apply(self, world, action):
        if action.name == "stop":
            return Outcome("stopped", end=Termination.ENV_TERMINAL_SUCCESS)
        n = action.args.get("n")
        if action.name != "add" or not isinstance(n, int) or n < 1:
            return Outcome('{"error": "bad"}', error="bad_arguments")
        return Outcome(f"n={world['n'] + n}", world={**world, "n": world["n"] + n}, cost=n)


def add(n: int) -> Action:
    return Action.tool("add", n=n)


def test_reset_step_clock_and_budget():
    env = SimEnv(Counter())
    with pytest.raises(EnvNotResetError):
        env.step(add(1))
    assert env.reset("count", 3) == "start at 3"
    t = env.step(add(4))
    assert (t.observation, t.done, t.step_index) == ("n=7", False, 1)
    state = env.current_state()
    assert (state.clock, state.steps, state.world()["n"]) == (4, 1, 7)
    t = env.step(add(6))  # clock 10 >= budget 10
    assert t.done and t.termination is Termination.TASK_BUDGET_EXHAUSTED_TERMINAL
    with pytest.raises(EpisodeDoneError):
        env.step(add(1))


def test_invalid_text_and_tool_errors_change_only_the_bookkeeping():
    env = SimEnv(Counter())
    env.reset("count", 0)
    t = env.step("not an action")
    assert t.error == "invalid_action" and "invalid_action" in t.observation
    t = env.step(add(0))
    assert t.error == "bad_arguments"
    state = env.current_state()
    assert state.world() == {"n": 0}
    assert (state.counters.invalid_actions, state.counters.tool_calls,
            state.counters.tool_errors) == (1, 1, 1)
    assert state.log == ((1, "<invalid>", "invalid_action"), (2, "add", "bad_arguments"))


def test_rules_may_end_the_episode_and_finish_ends_it():
    env = SimEnv(Counter())
    env.reset("count", 0)
    t = env.step(Action.tool("stop"))
    assert t.termination is Termination.ENV_TERMINAL_SUCCESS
    assert env.current_state().final_action == "stop"
    env.reset("count", 0)
    t = env.step(Action.abstain())
    assert t.termination is Termination.AGENT_FINISH
    assert env.current_state().final_action == "abstain"


def test_restore_rolls_back_and_forks_are_isolated():
    env = SimEnv(Counter())
    env.reset("count", 1)
    ref = env.snapshot("s0")
    env.step(add(2))
    fork = env.fork(ref, "b")
    assert fork.state_hash() == ref.state_hash
    fork.step(add(5))
    assert env.current_state().world() == {"n": 3}
    assert fork.current_state().world() == {"n": 6}
    env.restore(ref)
    assert env.state_hash() == ref.state_hash and env.current_state().world() == {"n": 1}


def test_a_world_cannot_be_aliased_through_the_state():
    env = SimEnv(Counter())
    env.reset("count", 1)
    ref = env.snapshot("s0")
    world = env.current_state().world()
    world["n"] = 99
    env.restore(ref)
    assert env.current_state().world() == {"n": 1}


def test_sealed_terminal_state_is_exported_but_never_restored():
    env = SimEnv(Counter())
    env.reset("count", 0)
    env.step(Action.finish())
    sealed = env.sealed_terminal()
    assert decode_sim_state(env.export_sealed(sealed)).done
    with pytest.raises(SealedSnapshotError):
        env.restore(sealed)
    with pytest.raises(EpisodeDoneError):
        env.snapshot("late")


def test_restore_refuses_a_reference_with_another_hash():
    env = SimEnv(Counter())
    env.reset("count", 0)
    ref = env.snapshot("s0")
    forged = dataclasses.replace(ref, state_hash="sha256:" + "0" * 64)
    with pytest.raises(SnapshotMismatchError):
        env.restore(forged)


def test_a_rule_set_that_refuses_snapshots_says_why():
    class Live(Counter):
        snapshot_refusal = "the state lives in another process"

    env = SimEnv(Live())
    env.reset("count", 0)
    with pytest.raises(SnapshotUnsupportedError, match="another process"):
        env.snapshot("s")
    assert issubclass(SnapshotUnsupportedError, NotImplementedError)
    env.step(Action.finish())  # episodes still run and seal
    assert env.sealed_terminal().label == "terminal"


def test_decode_rejects_edited_and_non_canonical_bytes():
    state = SimState.initial("counter-v1", "count", 0, 10, {"n": 1})
    assert decode_sim_state(state.to_bytes()) == state
    obj = json.loads(state.to_bytes())
    reordered = json.dumps(obj, indent=1).encode()
    with pytest.raises(StateDecodeError, match="canonical"):
        decode_sim_state(reordered)
    for key, value in (("steps", -1), ("done", 1), ("termination", "exploded"),
                       ("world", []), ("format", "other")):
        bad = {**obj, key: value}
        with pytest.raises(StateDecodeError):
            decode_sim_state(json.dumps(bad, sort_keys=True, separators=(",", ":")).encode())
    with pytest.raises(StateDecodeError):
        decode_sim_state(b"\xff")


def test_state_hash_covers_every_field():
    base = SimState.initial("counter-v1", "count", 0, 10, {"n": 1})
    for change in ({"clock": 1}, {"steps": 1}, {"seed": 1}, {"budget": 9}, {"done": True},
                   {"world_json": '{"n":2}'}, {"final_action": "finish"}):
        assert dataclasses.replace(base, **change).state_hash != base.state_hash


def test_catalog_ids_are_content_hashed_and_checked():
    from closedloop.envs.keydoor.tasks import CATALOG

    task = CATALOG.generate("keydoor-v1", "standard", 5)
    assert CATALOG.task(task.task_id) == task
    family, template, rest = task.task_id.split("/")
    with pytest.raises(TaskError, match="does not match"):
        CATALOG.task(f"{family}/{template}/{rest[:4]}00000000")
    for bad in ("keydoor-v1/standard", "nope-v1/standard/001-00000000",
                "keydoor-v1/missing/001-00000000", 7):
        with pytest.raises(TaskError):
            CATALOG.task(bad)


def test_task_sets_are_disjoint_round_robin_and_seeded():
    from closedloop.envs.searchqa.tasks import CATALOG

    sets = catalog_task_sets(CATALOG, TaskSetRequest(12, 4, seed=3))
    assert len(sets.train) == 12 and len(sets.heldout) == 4
    templates = [t.split("/")[1] for t in sets.train]
    assert len(set(templates[:6])) == 6  # one per train template before any repeats
    assert {t.split("/")[1] for t in sets.heldout} == {"birthplace-founded", "source-height"}
    assert catalog_task_sets(CATALOG, TaskSetRequest(12, 4, seed=3)) == sets
    assert catalog_task_sets(CATALOG, TaskSetRequest(12, 4, seed=4)).train != sets.train
    everything = draw_task_ids(CATALOG, "heldout", 48 + 24, 0)
    assert len(set(everything)) == 72
    with pytest.raises(EnvPackageError, match="has 72"):
        draw_task_ids(CATALOG, "heldout", 73, 0)
    with pytest.raises(EnvPackageError, match="options"):
        catalog_task_sets(CATALOG, TaskSetRequest(1, 1, options={"x": 1}))
