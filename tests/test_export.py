"""closedloop export: Parquet and Hugging Face datasets read back equal to the JSONL trace."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from closedloop.contracts import GroupLease, Termination, TraceWriter, read_trace
from closedloop.export import (
    ExportError,
    ExportMismatchError,
    arrow_schema,
    export_run,
    read_export,
    records_table,
    table_records,
)
from tests.factories import make_traj, make_turn

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**62, 2**62) |
    st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=8)
finite = st.floats(-1e6, 1e6, allow_nan=False)


def _lease(i: int) -> GroupLease:
    return GroupLease(f"g{i}", "run", "keydoor-v1/standard/000-e9b1d77d", i, "snap", "h",
                      "v0000", "s", 2)


def _write_run(root, n_episodes: int = 3):
    with TraceWriter(root / "traces" / "rollouts.jsonl") as w:
        for e in range(n_episodes):
            w.write(_lease(e))
            w.write(make_turn(episode_id=f"ep{e}", observation="caf\u00e9 \u2192 ok",
                              tool_args={"path": "a", "n": [1, {"x": None}]}))
            w.write(make_turn(turn=1, context_len=5, prompt=(9,), episode_id=f"ep{e}",
                              reward_components={"task_success": 1.0}, tool_args=None,
                              raw_model_logprobs=None, termination_reason=Termination.AGENT_FINISH))
            w.write(make_traj(episode_id=f"ep{e}", reward={"task_success": 1.0, "tool_calls": 2.0},
                              timings={"verify_s": 0.25}))
    with TraceWriter(root / "traces" / "eval-final.jsonl") as w:
        w.write(make_traj(episode_id="cut", num_turns=0, termination=Termination.TOOL_TIMEOUT,
                          reward=None, split="heldout"))


@pytest.mark.parametrize("fmt", ["parquet", "hf"])
def test_export_reads_back_equal_to_the_jsonl_trace(tmp_path, fmt):
    _write_run(tmp_path)
    result = export_run(tmp_path, fmt)
    assert dict(result.counts) == {"turns": 6, "trajectories": 4, "groups": 3}
    back = read_export(result.path, fmt)
    for stem in ("rollouts", "eval-final"):
        original = list(read_trace(tmp_path / "traces" / f"{stem}.jsonl"))
        exported = [r for table in ("groups", "turns", "trajectories") for s, r in back[table]
                    if s == stem]
        key = lambda r: (r.record, getattr(r, "episode_id", r.group_id),  # noqa: E731
                         getattr(r, "turn", 0))
        assert sorted(exported, key=key) == sorted(original, key=key)
    manifest = json.loads((result.path / "export.json").read_text())
    assert sorted(manifest["sources"]) == ["eval-final.jsonl", "rollouts.jsonl"]


def test_parquet_columns_are_native_where_the_field_is_typed(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    _write_run(tmp_path, 1)
    table = pq.read_table(export_run(tmp_path, "parquet").path / "turns.parquet")
    schema = table.schema
    assert schema.field("action_token_ids").type == pa.list_(pa.int64())
    assert schema.field("behavior_logprobs").type == pa.list_(pa.float64())
    assert schema.field("tool_args").type == pa.string()  # free-form JSON as text
    assert schema.field("sampler_config").type.num_fields == 4
    assert table.column("trace").to_pylist() == ["rollouts", "rollouts"]
    assert json.loads(table.column("tool_args").to_pylist()[0]) == {"n": [1, {"x": None}],
                                                                   "path": "a"}


@settings(max_examples=40, deadline=None)
@given(tool_args=st.none() | st.dictionaries(st.text(max_size=5), json_values, max_size=3),
       logprobs=st.lists(st.floats(-30.0, 0.0), min_size=1, max_size=4),
       timings=st.dictionaries(st.text(max_size=6), finite, max_size=3),
       observation=st.text(max_size=40), seed=st.integers(0, 2**62))
def test_any_turn_record_survives_the_table_round_trip(tool_args, logprobs, timings,
                                                       observation, seed):
    n = len(logprobs)
    turn = make_turn(action=tuple(range(n)), behavior_logprobs=logprobs,
                     raw_model_logprobs=None if seed % 2 else logprobs, tool_args=tool_args,
                     timings=timings, observation=observation, seed=seed)
    (stem, back), = table_records(type(turn), records_table(type(turn), [("t", turn)]))
    assert stem == "t" and back == turn
    assert all(math.copysign(1, a) == math.copysign(1, b)
               for a, b in zip(back.behavior_logprobs, logprobs, strict=True))


def test_a_lossy_round_trip_is_caught(tmp_path, monkeypatch):
    import closedloop.export as export

    _write_run(tmp_path, 1)
    real = export.table_records

    def drop_timings(cls, table):
        rows = real(cls, table)
        return [(s, r.__class__(**{**r.__dict__, "timings": {}})) if hasattr(r, "timings")
                else (s, r) for s, r in rows]

    monkeypatch.setattr(export, "table_records", drop_timings)
    with pytest.raises(ExportMismatchError, match="differs"):
        export_run(tmp_path, "parquet")


def test_refusals_name_the_problem(tmp_path):
    with pytest.raises(ExportError, match="no traces"):
        export_run(tmp_path, "parquet")
    _write_run(tmp_path, 1)
    with pytest.raises(ExportError, match="parquet or hf"):
        export_run(tmp_path, "csv")
    export_run(tmp_path, "parquet")
    with pytest.raises(ExportError, match="not empty"):
        export_run(tmp_path, "parquet")
    assert export_run(tmp_path, "parquet", overwrite=True).counts["turns"] == 2


def test_schema_has_a_column_per_field_and_the_trace():
    from dataclasses import fields

    from closedloop.contracts import TrajectoryRecord

    names = arrow_schema(TrajectoryRecord).names
    assert names == ["trace", *(f.name for f in fields(TrajectoryRecord))]


def test_cli_export_subcommand(tmp_path, capsys):
    from closedloop.cli import main

    _write_run(tmp_path, 2)
    assert main(["export", str(tmp_path), "--format", "hf", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["counts"] == {"groups": 2, "trajectories": 3, "turns": 4}
    assert main(["export", str(tmp_path), "--format", "hf"]) == 2  # exists: a named error
    assert "ExportError" in capsys.readouterr().err
