"""The episode contract, snapshots, forks and sealing of TerminalRepairEnv."""

import dataclasses

import pytest

from closedloop.contracts import Action, ContractError, SnapshotMismatchError, Termination
from closedloop.envs import (
    AgentEnv,
    EnvNotResetError,
    EpisodeDoneError,
    EpisodeNotDoneError,
    SandboxInfraError,
    SealedSnapshotError,
    TaskError,
    UnknownSnapshotError,
)
from closedloop.envs.terminal import TerminalRepairEnv, decode_sealed, decode_state
from closedloop.envs.terminal import sandbox as sandbox_module
from tests.envs.terminal.fixtures import (
    CLI_TASK,
    JSON_SHORT,
    JSON_TASK,
    json_task,
    make_env,
)

LIST = Action.tool("list_dir")
ROLL = Action.tool("run", command="roll")


def started(task=JSON_TASK, seed=1):
    env = make_env()
    env.reset(task, seed)
    return env


def test_is_an_agent_env():
    assert isinstance(make_env(), AgentEnv)


def test_reset_is_reproducible_and_seeded():
    a, b = make_env(), make_env()
    obs = a.reset(JSON_TASK, 7)
    assert obs == b.reset(JSON_TASK, 7)
    assert obs.startswith("Task: Make config.json valid JSON") and "validate: python3" in obs
    assert a.state_hash() == b.state_hash() and a.export_state() == b.export_state()
    a.step(LIST)
    a.reset(JSON_TASK, 7)
    assert a.export_state() == b.export_state()
    b.reset(JSON_TASK, 8)
    assert decode_state(b.export_state()).rng_hash != decode_state(a.export_state()).rng_hash


def bad_spec(**changes):
    return dataclasses.replace(json_task(), **changes)


@pytest.mark.parametrize("spec", [
    bad_spec(env_version="other-env-v9"),
    bad_spec(initial_files={".grader/answer.json": "{}"}),
    bad_spec(initial_files={"../x": ""}),
    bad_spec(allowed_tools=("read_file", "shell")),
    bad_spec(commands={"sh": ("bash", "-c", "ls")}),
    bad_spec(commands={"v": ("python3", "missing.py")}),
    bad_spec(step_budget=0),
    bad_spec(task_id="another-id"),
])
def test_invalid_tasks_are_refused_at_reset(spec):
    env = TerminalRepairEnv(lambda task_id: spec)
    with pytest.raises(TaskError):
        env.reset(json_task().task_id, 0)


def test_reset_errors():
    with pytest.raises(TaskError):
        make_env().reset("no-such-task", 0)
    with pytest.raises(TaskError):
        make_env().reset(JSON_TASK, True)
    with pytest.raises(TaskError):
        TerminalRepairEnv().reset(JSON_TASK, 0)
    for call in (lambda e: e.step(LIST), lambda e: e.export_state(), lambda e: e.snapshot("x")):
        with pytest.raises(EnvNotResetError):
            call(make_env())


def test_steps_consume_budget_and_report_state():
    env = started(JSON_SHORT)
    t1 = env.step(LIST)
    t2 = env.step("not an action")
    assert (t1.step_index, t2.step_index, t2.error) == (1, 2, "invalid_action")
    assert t2.state_version == env.state_hash() != t1.state_version
    t3 = env.step(LIST)
    assert (t3.done, t3.termination) == (True, Termination.TASK_BUDGET_EXHAUSTED_TERMINAL)
    state = decode_state(env.export_state())
    assert (state.steps, state.clock, state.counters.invalid_actions, state.final_action) == \
        (3, 3, 1, None)
    with pytest.raises(EpisodeDoneError):
        env.step(LIST)
    with pytest.raises(EpisodeDoneError):
        env.snapshot("after")


@pytest.mark.parametrize("action,kind", [(Action.finish(), "finish"),
                                         (Action.abstain(), "abstain"),
                                         ('<tool_call>{"name": "finish"}</tool_call>', "finish")])
def test_finish_and_abstain_end_the_episode(action, kind):
    env = started(JSON_SHORT)
    env.step(LIST)
    env.step(LIST)
    t = env.step(action)
    assert (t.done, t.termination, t.error) == (True, Termination.AGENT_FINISH, None)
    assert decode_state(env.export_state()).final_action == kind


def test_step_rejects_non_actions():
    with pytest.raises(ContractError):
        started().step(42)


def test_snapshot_ids_are_content_derived_and_chained():
    a, b = started(), started()
    ra1, rb1 = a.snapshot("s"), b.snapshot("s")
    assert ra1 == rb1 and ra1.parent_snapshot_id is None
    assert ra1.state_hash == a.state_hash() and ra1.env_version == "terminal-repair-v1"
    a.step(LIST)
    ra2 = a.snapshot("s")
    assert ra2.parent_snapshot_id == ra1.snapshot_id and ra2.snapshot_id != ra1.snapshot_id
    assert a.snapshot("other").snapshot_id != ra2.snapshot_id


def test_restore_returns_to_the_exact_state():
    env = started(CLI_TASK)
    ref = env.snapshot("t0")
    before = env.export_state()
    first = [env.step(a) for a in (ROLL, Action.tool("write_file", path="x", content="1"), ROLL)]
    env.restore(ref)
    assert env.export_state() == before and env.state_hash() == ref.state_hash
    again = [env.step(a) for a in (ROLL, Action.tool("write_file", path="x", content="1"), ROLL)]
    assert first == again
    assert first[0].observation != first[2].observation, "the RNG must advance between runs"


def test_restore_refuses_unknown_or_altered_snapshots():
    env = started()
    ref = env.snapshot("t0")
    with pytest.raises(UnknownSnapshotError):
        env.restore(dataclasses.replace(ref, snapshot_id="snap-missing"))
    for field, value in (("state_hash", "sha256:" + "0" * 64), ("rng_state_hash", "x"),
                         ("parent_snapshot_id", "p"), ("env_version", "v2"), ("label", "z")):
        with pytest.raises(SnapshotMismatchError):
            env.restore(dataclasses.replace(ref, **{field: value}))
    with pytest.raises(UnknownSnapshotError):
        started().restore(ref)


def test_restore_detects_a_tampered_store():
    env = started()
    ref = env.snapshot("t0")
    entry = env._store._entries[ref.snapshot_id]
    bad_files = entry.state.files.with_file("config.json", "{}", env.config.limits)
    tampered = dataclasses.replace(entry.state, files=bad_files)
    object.__setattr__(tampered, "state_hash", ref.state_hash)  # a lying cached hash
    env._store._entries[ref.snapshot_id] = dataclasses.replace(entry, state=tampered)
    with pytest.raises(SnapshotMismatchError):
        env.restore(ref)


def test_forks_are_isolated_and_share_the_rng_state():
    env = started(CLI_TASK)
    env.step(ROLL)
    ref = env.snapshot("branch")
    parent_bytes = env.export_state()
    fa, fb = env.fork(ref, "a"), env.fork(ref, "b")
    assert (fa.branch_id, fb.branch_id) == ("a", "b")
    assert fa.state_hash() == fb.state_hash() == ref.state_hash
    assert fa.step(ROLL) == fb.step(ROLL), "branch_id must not alter the environment RNG"
    fa.step(Action.tool("write_file", path="data.txt", content="9\n"))
    assert decode_state(fa.export_state()).files["data.txt"] == "9\n"
    assert decode_state(fb.export_state()).files["data.txt"] == "1;2,3,4\n"
    assert env.export_state() == parent_bytes
    assert env.fork(ref, "c").export_state() == parent_bytes
    fa.step(Action.finish())
    assert env.export_state() == parent_bytes and not decode_state(parent_bytes).done


def test_terminal_state_is_sealed_and_never_restorable():
    env = started(JSON_SHORT)
    with pytest.raises(EpisodeNotDoneError):
        env.sealed_terminal()
    mid = env.snapshot("mid")
    env.step(Action.tool("write_file", path="answer.txt", content="42"))
    env.step(Action.finish())
    sealed = env.sealed_terminal()
    assert sealed.label == "terminal" and sealed.state_hash == env.state_hash()
    assert sealed.parent_snapshot_id == mid.snapshot_id
    data = env.export_sealed(sealed)
    assert data == env.export_state()
    assert decode_sealed(sealed, data).files["answer.txt"] == "42"
    with pytest.raises(SealedSnapshotError):
        env.restore(sealed)
    with pytest.raises(SealedSnapshotError):
        env.fork(sealed, "peek")
    with pytest.raises(SnapshotMismatchError):
        env.export_sealed(mid)
    with pytest.raises(SnapshotMismatchError):
        decode_sealed(mid, data)


def test_sealed_bytes_are_hash_checked():
    env = started(JSON_SHORT)
    env.step(Action.finish())
    sealed = env.sealed_terminal()
    entry = env._store._entries[sealed.snapshot_id]
    forged = entry.sealed_bytes.replace(b'"final_action":"finish"', b'"final_action":"abstain"')
    env._store._entries[sealed.snapshot_id] = dataclasses.replace(entry, sealed_bytes=forged)
    with pytest.raises(SnapshotMismatchError):
        env.export_sealed(sealed)


def test_restoring_mid_episode_after_the_end_unseals_nothing():
    env = started(JSON_SHORT)
    ref = env.snapshot("t0")
    env.step(Action.finish())
    sealed = env.sealed_terminal()
    env.restore(ref)
    with pytest.raises(EpisodeNotDoneError):
        env.sealed_terminal()
    assert env.export_sealed(sealed) != env.export_state()


def test_reset_starts_a_new_snapshot_store():
    env = started()
    ref = env.snapshot("old")
    env.reset(JSON_TASK, 1)
    with pytest.raises(UnknownSnapshotError):
        env.restore(ref)


def test_sandbox_infrastructure_failure_consumes_nothing(monkeypatch):
    env = started(CLI_TASK)
    before = env.export_state()

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(sandbox_module.tempfile, "mkdtemp", broken)
    with pytest.raises(SandboxInfraError):
        env.step(ROLL)
    assert env.export_state() == before
