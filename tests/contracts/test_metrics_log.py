"""metrics.jsonl: keyed exactly-once records, torn tails repaired, corrupt lines named."""

import json

import pytest

from closedloop.contracts.metrics_log import (
    MetricsFormatError,
    MetricsLog,
    metrics_key,
    read_metrics,
)


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_each_key_is_written_once_and_volatile_fields_do_not_count(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    assert log.put({"kind": "eval", "label": "start", "pass": 0.5, "time": 1.0})
    assert log.put({"kind": "rl_step", "step": 0, "loss": 1.0, "seconds": {"a": 1}})
    # a relaunch logging the same records again: nothing changes on disk
    again = MetricsLog(path)
    assert not again.put({"kind": "eval", "label": "start", "pass": 0.5, "time": 99.0})
    assert not again.put({"kind": "rl_step", "step": 0, "loss": 1.0, "seconds": {"a": 7}})
    assert again.put({"kind": "rl_step", "step": 1, "loss": 0.5})
    assert [(r["kind"], r.get("step"), r.get("label")) for r in lines(path)] == [
        ("eval", None, "start"), ("rl_step", 0, None), ("rl_step", 1, None)]
    assert lines(path)[0]["time"] == 1.0  # the first write stands


def test_a_changed_record_replaces_its_line_in_place(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    for step in range(3):
        log.put({"kind": "task_sampler", "step": step, "n": step})
    log.put({"kind": "task_sampler", "step": 1, "n": 10})
    assert [r["n"] for r in lines(path)] == [0, 10, 2]
    assert [r["n"] for r in MetricsLog(path)] == [0, 10, 2]


def test_a_torn_last_line_is_cut_off_never_appended_to(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    log.put({"kind": "rl_step", "step": 0, "loss": 1.0})
    full = json.dumps({"kind": "rl_step", "step": 1, "loss": 0.25})
    with open(path, "a") as fh:
        fh.write(full[: len(full) // 2])  # a writer killed mid-line
    with pytest.raises(MetricsFormatError, match=r"line 2.*cut short"):
        read_metrics(path)
    repaired = MetricsLog(path)
    assert repaired.repaired_tail and ("rl_step", 1, None) not in repaired
    repaired.put({"kind": "rl_step", "step": 1, "loss": 0.25})
    assert [r["step"] for r in read_metrics(path)] == [0, 1]
    assert not MetricsLog(path).repaired_tail


@pytest.mark.parametrize("content, line, field", [
    ('{"kind": "a", "step": 0}\n{"kind": "a", "step": 0}\n', 2, "kind"),  # a repeated key
    ('{"kind": "a"}\nnot json\n{"kind": "b"}\n', 2, "<line>"),
    ('{"kind": "a"}\n\n', 2, "<line>"),
    ('[1, 2]\n', 1, "<line>"),
    ('{"step": 3}\n', 1, "kind"),
    ('{"kind": "a", "step": "3"}\n', 1, "step"),
    ('{"kind": "a", "label": 7}\n', 1, "label"),
])
def test_a_corrupt_line_is_refused_naming_file_line_and_field(tmp_path, content, line, field):
    path = tmp_path / "metrics.jsonl"
    path.write_text(content)
    with pytest.raises(MetricsFormatError) as info:
        MetricsLog(path)
    assert (info.value.line, info.value.field) == (line, field)
    assert str(path) in str(info.value)
    assert path.read_text() == content  # refused, not repaired


def test_bytes_that_are_not_utf8_are_refused(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"kind": "a"}\n\xff\n')
    with pytest.raises(MetricsFormatError, match="not UTF-8"):
        MetricsLog(path)


def test_key_of_a_record():
    assert metrics_key({"kind": "eval", "label": "final"}) == ("eval", None, "final")
    assert metrics_key({"kind": "rl_step", "step": 3, "x": 1}) == ("rl_step", 3, None)
    with pytest.raises(ValueError, match="step"):
        metrics_key({"kind": "rl_step", "step": True})
