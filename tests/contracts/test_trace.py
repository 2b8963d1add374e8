"""Trace records: round trips, validation, and corrupt lines named by line, field and reason."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from closedloop.contracts import (
    ContractError,
    PolicyManifest,
    Termination,
    TraceFormatError,
    TraceWriter,
    load_episodes,
    read_trace,
    record_from_line,
    record_to_line,
    sha256_hex,
)
from tests.factories import SAMPLER, H, make_traj, make_turn


def test_round_trip_turn_and_trajectory():
    for rec in (make_turn(), make_traj()):
        assert record_from_line(record_to_line(rec)) == rec


def test_episode_threading(tmp_path):
    path = tmp_path / "trace.jsonl"
    with TraceWriter(path) as w:
        w.write(make_turn(0))
        w.write(make_turn(1, prompt=(6, 7), action=(8,), context_len=7))
        w.write(make_traj())
    _, episodes = load_episodes(path)
    (ep,) = episodes
    assert ep.context_token_ids(1) == [1, 2, 3, 4, 5, 6, 7]


def test_threading_gap_is_rejected(tmp_path):
    path = tmp_path / "trace.jsonl"
    with TraceWriter(path) as w:
        w.write(make_turn(0))
        w.write(make_turn(1, prompt=(6, 7), action=(8,), context_len=6))  # off by one
        w.write(make_traj())
    with pytest.raises(TraceFormatError) as info:
        load_episodes(path)
    assert info.value.field == "context_len_before"


def test_mixed_versions_in_one_episode_rejected(tmp_path):
    path = tmp_path / "trace.jsonl"
    with TraceWriter(path) as w:
        w.write(make_turn(0))
        w.write(make_turn(1, prompt=(6,), action=(8,), context_len=6, version="v0001"))
        w.write(make_traj())
    with pytest.raises(TraceFormatError, match="mixed behaviour versions"):
        load_episodes(path)


def test_censored_episode_cannot_carry_a_score():
    with pytest.raises(ContractError, match="censored"):
        make_traj(termination=Termination.TOOL_TIMEOUT, reward={"task_success": 0.0})
    assert make_traj(termination=Termination.TOOL_TIMEOUT).reward is None


CORRUPTIONS = [
    (lambda d: d.update(turn="3"), "turn", "expected an int"),
    (lambda d: d.update(turn=True), "turn", "expected an int"),
    (lambda d: d.pop("action_token_ids"), "action_token_ids", "missing required field"),
    (lambda d: d.update(surprise=1), "surprise", "unknown field"),
    (lambda d: d["sampler_config"].update(top_p=2.0), "sampler_config", "top_p"),
    (lambda d: d.update(termination_reason="crashed"), "termination_reason", "must be one of"),
    (lambda d: d.update(action_token_ids=[1, "2"]), "action_token_ids[1]", "expected an int"),
    (lambda d: d.update(behavior_logprobs=[-0.5]), "behavior_logprobs", "length-aligned"),
    (lambda d: d.update(record="bogus"), "record", "must be one of"),
]


@pytest.mark.parametrize("mutate, field, reason", CORRUPTIONS)
def test_corrupt_lines_name_line_field_and_reason(tmp_path, mutate, field, reason):
    good = record_to_line(make_turn())
    bad = json.loads(good)
    mutate(bad)
    path = tmp_path / "trace.jsonl"
    path.write_text(good + "\n" + good + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(TraceFormatError) as info:
        list(read_trace(path))
    assert info.value.line == 3
    assert info.value.field == field
    assert reason in str(info.value)


def test_non_json_and_nan_lines(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"record": "turn", \n')
    with pytest.raises(TraceFormatError, match="line 1"):
        list(read_trace(path))
    line = record_to_line(make_turn()).replace("-0.5", "NaN", 1)
    with pytest.raises(TraceFormatError, match="not valid JSON"):
        record_from_line(line, 5)


@given(st.lists(st.integers(0, 49151), min_size=1, max_size=20),
       st.lists(st.floats(-30, 0, allow_nan=False), min_size=1, max_size=20))
@settings(max_examples=100)
def test_round_trip_property(ids, lps):
    n = min(len(ids), len(lps))
    rec = make_turn(action=ids[:n], behavior_logprobs=lps[:n], raw_model_logprobs=None)
    assert record_from_line(record_to_line(rec)) == rec


def test_manifest_scaffold_hash_ignores_weights_only():
    m = PolicyManifest("v0000", H, H, H, H, H, "action-parser-v1", "exact-history-v1", None, 1, 8,
                       64, SAMPLER)
    m2 = m.with_weights("v0001", sha256_hex("w2"))
    assert m2.scaffold_hash() == m.scaffold_hash()
    assert m2.manifest_hash() != m.manifest_hash()
    drifted = PolicyManifest.from_dict({**m.to_dict(), "system_prompt_hash": sha256_hex("p2")})
    assert drifted.scaffold_hash() != m.scaffold_hash()
    assert PolicyManifest.from_dict(m.to_dict()) == m
    with pytest.raises(ContractError, match="unknown manifest fields"):
        PolicyManifest.from_dict({**m.to_dict(), "typo": 1})


def test_lone_surrogates_in_tool_args_round_trip_as_valid_utf8(tmp_path):
    # '{"path": "a\udbff.txt"}' is pure ASCII model text; JSON decodes it to a lone surrogate
    rec = make_turn(tool_args={"path": "a\udbff.txt", "k\udc00": ["\ud800"]})
    path = tmp_path / "trace.jsonl"
    with TraceWriter(path) as w:
        w.write(rec)
    path.read_bytes().decode("utf-8")  # strict: the file is valid UTF-8
    (back,) = read_trace(path)
    assert back == rec


def test_errors_name_the_file_and_a_torn_last_line(tmp_path):
    good = record_to_line(make_turn())
    path = tmp_path / "step-0003.jsonl"
    path.write_text(good + "\n" + good[: len(good) // 2])  # a writer killed mid-line
    with pytest.raises(TraceFormatError, match="cut short") as info:
        list(read_trace(path))
    assert str(path) in str(info.value) and info.value.line == 2
    path.write_text(good + "\n" + good.replace('"turn":0', '"turn":"0"') + "\n")
    with pytest.raises(TraceFormatError) as info:
        load_episodes(path)
    assert info.value.path == str(path) and f"{path}: trace line 2" in str(info.value)
    path.write_bytes(good.encode() + b"\n\xff\xfe\n")
    with pytest.raises(TraceFormatError, match="not UTF-8") as info:
        list(read_trace(path))
    assert info.value.path == str(path)
    with pytest.raises(TraceFormatError, match="cannot read") as info:
        load_episodes(tmp_path / "missing.jsonl")
    assert "missing.jsonl" in str(info.value)
