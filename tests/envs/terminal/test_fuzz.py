"""Malformed or hostile action text never crashes the env and never changes the world state.

Hostile text includes lone surrogates: JSON's ``\\udXXX`` escapes turn pure-ASCII model text
into strings UTF-8 cannot encode; every tool must refuse them (``bad_arguments``) before it
touches the state, so ``state_hash``/``export_state`` keep working after every step.
"""

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from closedloop.contracts import ActionParseError, parse_action
from closedloop.envs.terminal import decode_state
from tests.envs.terminal.fixtures import JSON_LONG, make_env

FRAGMENTS = ["<tool_call>", "</tool_call>", "{", "}", '"name"', ":", ",", '"arguments"',
             '"read_file"', '"write_file"', '"finish"', '"path"', '"../x"', "[", "]", "null",
             "NaN", "1e999", "\\u0000", " ", "\n", "💥", '"', "true"]
# text with lone surrogates (category Cs) mixed in, as JSON escapes or as raw characters
hostile_text = st.text(st.characters(categories=["Cs"]) | st.characters(), max_size=12)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12)
    | hostile_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=6)
names = st.sampled_from(["read_file", "write_file", "replace", "list_dir", "run", "rm", "Finish",
                         "finish", "abstain", "", "read file"]) | st.text(max_size=8)
arg_keys = st.sampled_from(["path", "content", "old", "new", "count", "command", "args", "x"]) \
    | hostile_text
calls = st.fixed_dictionaries(
    {"name": names | json_values},
    optional={"arguments": st.dictionaries(arg_keys, json_values, max_size=4) | json_values,
              "extra": json_values})
texts = st.one_of(
    st.text(max_size=60),
    hostile_text,
    st.lists(st.sampled_from(FRAGMENTS), max_size=14).map("".join),
    st.tuples(st.text(max_size=8), calls, st.text(max_size=8)).map(
        lambda t: f"{t[0]}<tool_call>{json.dumps(t[1])}</tool_call>{t[2]}"),
    st.tuples(calls, st.booleans()).map(  # surrogates raw instead of escaped
        lambda t: f"<tool_call>{json.dumps(t[0], ensure_ascii=t[1])}</tool_call>"),
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
    assert env.state_hash() == t.state_version
    assert t.step_index == 1 and after.clock == 1
    if action is None:
        assert t.error == "invalid_action" and not t.done
        assert json.loads(t.observation)["error"]["code"] == "invalid_action"
        assert after.counters.invalid_actions == 1 and after.counters.tool_calls == 0
    if t.error is not None:
        assert dict(after.files) == dict(base.files)
        assert after.rng_hash == base.rng_hash



SURROGATES = ["\ud800", "\udbff", "\udc00", "\udfff", "\ud83d"]
TOOL_ARGS = {
    "write_file": ("path", "content"), "read_file": ("path",), "list_dir": ("path",),
    "replace": ("path", "old", "new"), "run": ("command", "args"),
}


def hostile_action(rng: random.Random) -> tuple[str, bool]:
    """One tool call whose arguments may hold a lone surrogate (in a value, a key or a list
    item), JSON-escaped (pure ASCII text) or raw; returns (text, holds a surrogate)."""
    name = rng.choice(sorted(TOOL_ARGS))
    args: dict[str, object] = {}
    for key in TOOL_ARGS[name]:
        args[key] = rng.choice(["config.json", "a.txt", "sub/x.txt", "80", "validate", ""])
    if name == "run":
        args["command"] = rng.choice(["validate", "nope"])
        args["args"] = [rng.choice(["a", "b"]) for _ in range(rng.randrange(3))]
    hostile = rng.random() < 0.8
    if hostile:
        # one at a time: a high surrogate followed by a low one would be a valid pair
        bad = rng.choice(SURROGATES)
        where = rng.choice(["value", "key", "list"] if name == "run" else ["value", "key"])
        if where == "key":
            args[f"k{bad}"] = "x"
        elif where == "list":
            args["args"] = [*args["args"], f"x{bad}"]  # type: ignore[misc]
        else:
            key = rng.choice(TOOL_ARGS[name])
            args[key] = f"a{bad}.txt" if key != "args" else [bad]
    elif name == "run":
        args["command"] = "nope"  # never start a process: a disallowed command
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=rng.random() < 0.7)
    return f"<tool_call>{body}</tool_call>", hostile


def test_ten_thousand_hostile_actions_raise_nothing_and_change_nothing(env_at_base):
    """10,000 seeded tool calls, 80% with a lone surrogate: no exception out of ``step()``, a
    ``bad_arguments`` error for each surrogate, and no state change on any error step."""
    env, snap, base = env_at_base
    rng = random.Random(16)
    n_hostile = n_errors = 0
    for _ in range(10_000):
        text, hostile = hostile_action(rng)
        env.restore(snap)
        t = env.step(text)
        after = decode_state(env.export_state())
        assert env.state_hash() == t.state_version
        if hostile:
            n_hostile += 1
            assert t.error == "bad_arguments", (ascii(text), t.observation)
            t.observation.encode("utf-8")
        if t.error is not None:
            n_errors += 1
            assert dict(after.files) == dict(base.files), ascii(text)
            assert after.rng_hash == base.rng_hash
            assert after.counters.tool_errors == 1
    assert n_hostile > 7_500 and n_errors >= n_hostile
