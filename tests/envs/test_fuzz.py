"""Malformed or hostile action text never crashes the env and never changes the world state."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from closedloop.contracts import ActionParseError, parse_action
from closedloop.envs import decode_state
from tests.envs.fixtures import JSON_LONG, make_env

FRAGMENTS = ["<tool_call>", "</tool_call>", "{", "}", '"name"', ":", ",", '"arguments"',
             '"read_file"', '"write_file"', '"finish"', '"path"', '"../x"', "[", "]", "null",
             "NaN", "1e999", "\\u0000", " ", "\n", "💥", '"', "true"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=6)
names = st.sampled_from(["read_file", "write_file", "replace", "list_dir", "run", "rm", "Finish",
                         "finish", "abstain", "", "read file"]) | st.text(max_size=8)
arg_keys = st.sampled_from(["path", "content", "old", "new", "count", "command", "args", "x"])
calls = st.fixed_dictionaries(
    {"name": names | json_values},
    optional={"arguments": st.dictionaries(arg_keys, json_values, max_size=4) | json_values,
              "extra": json_values})
texts = st.one_of(
    st.text(max_size=60),
    st.lists(st.sampled_from(FRAGMENTS), max_size=14).map("".join),
    st.tuples(st.text(max_size=8), calls, st.text(max_size=8)).map(
        lambda t: f"{t[0]}<tool_call>{json.dumps(t[1])}</tool_call>{t[2]}"),
)


@pytest.fixture(scope="module")
def env_at_base():
    env = make_env()
    env.reset(JSON_LONG, 0)
    return env, env.snapshot("fuzz-base"), decode_state(env.export_state())


@settings(max_examples=2000, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow,
                                 HealthCheck.function_scoped_fixture])
@given(texts)
def test_malformed_text_never_crashes_or_changes_the_world(env_at_base, text):
    env, snap, base = env_at_base
    env.restore(snap)
    try:
        action = parse_action(text)
    except ActionParseError:
        action = None
    if action is not None and action.name == "run" and action.args.get("command") == "validate":
        return  # a well-formed command call; it would run a process
    t = env.step(text)
    after = decode_state(env.export_state())
    assert t.step_index == 1 and after.clock == 1
    if action is None:
        assert t.error == "invalid_action" and not t.done
        assert json.loads(t.observation)["error"]["code"] == "invalid_action"
        assert after.counters.invalid_actions == 1 and after.counters.tool_calls == 0
    if t.error is not None:
        assert dict(after.files) == dict(base.files)
        assert after.rng_hash == base.rng_hash

