"""Tool semantics and the no-side-effects rule for failing calls, through the environment."""

import json

import pytest

from closedloop.contracts import Action
from closedloop.envs.terminal import (
    EnvConfig,
    SandboxConfig,
    WorkspaceLimits,
    decode_state,
    tool_schemas,
)
from tests.envs.terminal.fixtures import CLI_TASK, JSON_TASK, READONLY_TASK, make_env, source


def fresh(task=JSON_TASK, config=None):
    env = make_env(config)
    env.reset(task, 1)
    return env


def files_of(env):
    return dict(decode_state(env.export_state()).files)


def error_of(t):
    return json.loads(t.observation)["error"]


def test_list_dir():
    env = fresh()
    t = env.step(Action.tool("list_dir"))
    assert t.error is None
    assert t.observation.splitlines() == [
        "./ (4 entries)", "README.md  42 bytes", "config.json  30 bytes", "sub/",
        f"validate.py  {len(source(JSON_TASK).initial_files['validate.py'])} bytes"]
    assert env.step(Action.tool("list_dir", path="sub/")).observation.splitlines()[1] == \
        "notes.txt  13 bytes"
    assert env.step(Action.tool("list_dir", path="nope")).error == "not_found"
    assert env.step(Action.tool("list_dir", path="README.md")).error == "not_a_directory"


def test_read_file_and_truncation_label():
    env = fresh(config=EnvConfig(read_cap_bytes=10))
    t = env.step(Action.tool("read_file", path="README.md"))
    assert t.observation == "# demo\nRun\n[... output truncated at 10 bytes ...]"
    assert fresh().step(Action.tool("read_file", path="config.json")).observation == \
        '{"name": "demo", "port": 80,}\n'
    assert fresh().step(Action.tool("read_file", path="sub")).error == "is_a_directory"


def test_write_and_replace():
    env = fresh()
    t = env.step(Action.tool("write_file", path="new/dir/a.txt", content="é\n"))
    assert (t.error, t.observation) == (None, "wrote 3 bytes to new/dir/a.txt")
    t = env.step(Action.tool("replace", path="config.json", old="80,}", new="80}"))
    assert (t.error, t.observation) == (None, "replaced 1 occurrence in config.json")
    files = files_of(env)
    assert files["config.json"] == '{"name": "demo", "port": 80}\n'
    assert files["new/dir/a.txt"] == "é\n"
    t = env.step(Action.tool("replace", path="config.json", old='"', new="'", count=6))
    assert t.error is None and files_of(env)["config.json"] == "{'name': 'demo', 'port': 80}\n"


@pytest.mark.parametrize("action,code", [
    (Action.tool("replace", path="config.json", old='"', new="'"), "ambiguous_match"),
    (Action.tool("replace", path="config.json", old='"', new="'", count=3), "count_mismatch"),
    (Action.tool("replace", path="config.json", old="zzz", new="y"), "not_found"),
    (Action.tool("replace", path="config.json", old="", new="y"), "bad_arguments"),
    (Action.tool("replace", path="config.json", old="a", new="y", count=0), "bad_arguments"),
    (Action.tool("replace", path="missing.json", old="a", new="y"), "not_found"),
    (Action.tool("write_file", path="sub", content="x"), "is_a_directory"),
    (Action.tool("write_file", path="README.md/x", content="x"), "not_a_directory"),
    (Action.tool("write_file", path="a.txt", content="x" * 300), "limit_exceeded"),
    (Action.tool("write_file", path="a.txt"), "bad_arguments"),
    (Action.tool("write_file", path="a.txt", content=5), "bad_arguments"),
    (Action.tool("write_file", path="a.txt", content="x", mode="w"), "bad_arguments"),
    (Action.tool("write_file", path="a//b", content="x"), "bad_arguments"),
    (Action.tool("read_file", path=["a"]), "bad_arguments"),
    (Action.tool("run", command="validate", args="x"), "bad_arguments"),
    (Action.tool("run", command="validate", args=[1]), "bad_arguments"),
    (Action.tool("rm", path="x"), "unknown_tool"),
])
def test_failing_calls_change_nothing_but_counters(action, code):
    env = fresh(config=EnvConfig(limits=WorkspaceLimits(max_file_bytes=256)))
    before = decode_state(env.export_state())
    t = env.step(action)
    after = decode_state(env.export_state())
    assert (t.error, error_of(t)["code"]) == (code, code)
    assert dict(after.files) == dict(before.files)
    assert after.rng_hash == before.rng_hash
    assert (after.steps, after.clock) == (before.steps + 1, before.clock + 1)
    assert after.counters.tool_errors == 1 and after.counters.violations == ()


@pytest.mark.parametrize("action,violation", [
    (Action.tool("read_file", path="../etc/passwd"), "path_escape"),
    (Action.tool("read_file", path="/etc/passwd"), "path_escape"),
    (Action.tool("write_file", path="../x.txt", content="x"), "path_escape"),
    (Action.tool("list_dir", path=".."), "path_escape"),
    (Action.tool("read_file", path=".grader/answer.json"), "reserved_path"),
    (Action.tool("write_file", path=".closedloop/state", content="{}"), "reserved_path"),
    (Action.tool("replace", path=".grader/x", old="a", new="b"), "reserved_path"),
    (Action.tool("run", command="validate", args=["../../etc/passwd"]), "path_escape"),
    (Action.tool("run", command="validate", args=["--out=/etc/x"]), "path_escape"),
    (Action.tool("run", command="validate", args=[".grader/answer"]), "reserved_path"),
    (Action.tool("run", command="bash"), "command_not_allowed"),
])
def test_denied_calls_are_policy_violations(action, violation):
    env = fresh()
    before = decode_state(env.export_state())
    t = env.step(action)
    after = decode_state(env.export_state())
    assert t.error in ("path_denied", "command_not_allowed")
    assert dict(after.files) == dict(before.files)
    assert [(v.step, v.code) for v in after.counters.violations] == [(1, violation)]


def test_tool_not_in_the_allowlist_is_a_violation():
    env = fresh(READONLY_TASK)
    t = env.step(Action.tool("write_file", path="a.txt", content="x"))
    state = decode_state(env.export_state())
    assert t.error == "tool_not_allowed" and "a.txt" not in state.files
    assert [v.code for v in state.counters.violations] == ["tool_not_allowed"]


def test_run_executes_and_keeps_writes():
    env = fresh(CLI_TASK)
    t = env.step(Action.tool("run", command="test"))
    assert t.error is None and "exit code: 1" in t.observation and "ValueError" in t.observation
    env.step(Action.tool("replace", path="data.txt", old=";", new=","))
    t = env.step(Action.tool("run", command="test"))
    assert t.observation == "$ run test\nexit code: 0\n--- stdout ---\nPASS\n\n--- stderr ---\n"
    env.step(Action.tool("write_file", path="out/keep.txt", content=""))
    t = env.step(Action.tool("run", command="save", args=["a", "b"]))
    assert t.error is None and files_of(env)["out/result.txt"] == "saved a b\n"
    counters = decode_state(env.export_state()).counters
    assert (counters.commands_run, counters.tool_errors, counters.timeouts) == (3, 0, 0)


def test_sandbox_refusals_become_violations():
    env = fresh(CLI_TASK)
    env.step(Action.tool("write_file", path="prog.py", content="open('/etc/hostname')\n"))
    t = env.step(Action.tool("run", command="run"))
    assert t.error is None and "sandbox: path refused" in t.observation
    codes = [v.code for v in decode_state(env.export_state()).counters.violations]
    assert codes == ["sandbox_path"]


def test_command_timeout_is_an_error_observation_without_side_effects():
    env = fresh(CLI_TASK, EnvConfig(sandbox=SandboxConfig(timeout_s=1.0)))
    env.step(Action.tool("write_file", path="prog.py",
                         content="open('w.txt', 'w').write('x')\nwhile True:\n    pass\n"))
    before = decode_state(env.export_state())
    t = env.step(Action.tool("run", command="run"))
    after = decode_state(env.export_state())
    assert (t.error, error_of(t)["code"], t.done) == ("tool_timeout", "tool_timeout", False)
    assert "killed" in error_of(t)["message"]
    assert dict(after.files) == dict(before.files)
    assert (after.counters.timeouts, after.counters.commands_run) == (1, 1)


def test_tool_schemas_follow_the_allowlist():
    names = [s["name"] for s in tool_schemas(source(READONLY_TASK))]
    assert names == ["list_dir", "read_file"]
    run = next(s for s in tool_schemas(source(CLI_TASK)) if s["name"] == "run")
    assert run["parameters"]["properties"]["command"]["enum"] == ["roll", "run", "save", "test"]
