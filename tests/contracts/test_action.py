"""Action parsing: canonical forms, whitespace invariance, and malformed text never crashes."""

import contextlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from closedloop.contracts import Action, ActionParseError, ContractError, parse_action

json_scalars = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=20)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)
names = st.from_regex(r"[a-z][a-z0-9_]{0,15}", fullmatch=True).filter(
    lambda n: n not in ("finish", "abstain"))
args_st = st.dictionaries(st.text(max_size=10), json_values, max_size=4)
whitespace = st.sampled_from(["", " ", "\n", "\t", "  \n "])


def test_parse_tool_call_with_rationale():
    text = ('I will read it.\n<tool_call>{"name": "read_file", '
            '"arguments": {"path": "a.json"}}</tool_call>\n')
    assert parse_action(text) == Action.tool("read_file", path="a.json")


def test_reserved_names_map_to_kinds():
    assert parse_action('<tool_call>{"name":"finish"}</tool_call>').kind == "finish"
    abstain = '<tool_call>{"name":"abstain","arguments":{}}</tool_call>'
    assert parse_action(abstain).kind == "abstain"


def test_canonical_text_is_stable():
    a = Action.tool("replace", path="p", old="x", new="y")
    assert a.canonical_text() == (
        '<tool_call>{"arguments":{"new":"y","old":"x","path":"p"},"name":"replace"}</tool_call>')


def test_model_text_names_the_tool_first_and_keeps_the_argument_order():
    a = Action.tool("replace", path="p", old="x", new="y")
    assert a.model_text() == (
        '<tool_call>{"name":"replace","arguments":{"path":"p","old":"x","new":"y"}}</tool_call>')
    assert parse_action(a.model_text()) == a


@given(name=names, args=args_st)
@settings(max_examples=200)
def test_model_text_parses_to_the_same_action(name, args):
    action = Action("tool", name, args)
    assert parse_action(action.model_text()) == action


@given(name=names, args=args_st, ws=st.lists(whitespace, min_size=4, max_size=4),
       indent=st.sampled_from([None, 1, 2]), order=st.booleans())
@settings(max_examples=300)
def test_whitespace_variants_parse_to_one_canonical_action(name, args, ws, indent, order):
    obj = {"name": name, "arguments": args} if order else {"arguments": args, "name": name}
    body = json.dumps(obj, indent=indent)
    text = f"{ws[0]}<tool_call>{ws[1]}{body}{ws[2]}</tool_call>{ws[3]}"
    action = parse_action(text)
    assert action == Action("tool", name, args)
    assert parse_action(action.canonical_text()) == action
    assert action.canonical_text() == Action("tool", name, args).canonical_text()


@pytest.mark.parametrize("text, reason", [
    ("no call here", "no <tool_call>"),
    ('<tool_call>{"name":"read_file"}', "not closed"),
    ('<tool_call>{"name":"read_file"</tool_call>', "not valid JSON"),
    ('<tool_call>[1,2]</tool_call>', "must be an object"),
    ('<tool_call>{"name":"read_file","arguments":[]}</tool_call>', "'arguments' must be"),
    ('<tool_call>{"name":"read_file","extra":1}</tool_call>', "unknown keys"),
    ('<tool_call>{"arguments":{}}</tool_call>', "no string 'name'"),
    ('<tool_call>{"name":"Read File"}</tool_call>', "lower_snake"),
    ('<tool_call>{"name":"a"}</tool_call><tool_call>{"name":"b"}</tool_call>', "more than one"),
    ('<tool_call>{"name":"a"}</tool_call> and more', "text after"),
    ('<tool_call>{"name":"a","arguments":{"x":NaN}}</tool_call>', "non-finite"),
])
def test_malformed_calls_name_the_reason(text, reason):
    with pytest.raises(ActionParseError) as info:
        parse_action(text)
    assert reason in info.value.reason


@given(st.text(max_size=200) | st.binary(max_size=100).map(lambda b: b.decode("latin-1")))
@settings(max_examples=3000)
def test_arbitrary_text_never_crashes(text):
    try:
        action = parse_action(text)
    except ActionParseError:
        return
    assert isinstance(action, Action)


@given(st.text(alphabet='<>/{}[]":,tool_cal nmeargus0123\\', max_size=80))
@settings(max_examples=2000)
def test_delimiter_soup_never_crashes(text):
    with contextlib.suppress(ActionParseError):
        parse_action("<tool_call>" + text)


def test_invalid_action_objects_are_rejected():
    with pytest.raises(ContractError):
        Action("tool", "finish", {})
    with pytest.raises(ContractError):
        Action("finish", "done", {})
    with pytest.raises(ContractError):
        Action.tool("write_file", content=float("inf"))
