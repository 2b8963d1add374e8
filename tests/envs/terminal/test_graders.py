"""Hidden graders: each kind accepts the right artifact and rejects near misses."""

from __future__ import annotations

import pytest

from closedloop.envs.terminal.graders import UnknownGraderError, grade, run_program, strict_equal


def test_strict_equal_distinguishes_json_types() -> None:
    assert strict_equal({"a": [1, "x", True]}, {"a": [1, "x", True]})
    assert not strict_equal(1, 1.0)
    assert not strict_equal(1, True)
    assert not strict_equal("8080", 8080)
    assert not strict_equal([1, 2], [1, 2, 3])
    assert strict_equal({"a": 1, "b": 2}, {"b": 2, "a": 1})


def test_json_equal() -> None:
    checks = {"kind": "json_equal", "path": "c.json", "expected": {"port": 80, "on": True}}
    assert grade(checks, {"c.json": '{"on": true, "port": 80}'}).passed
    assert grade(checks, {"c.json": '{\n "port": 80,\n "on": true\n}\n'}).passed
    for bad in ('{"port": "80", "on": true}', '{"port": 80, "on": 1}', '{"port": 80,}',
                '{"port": 81, "port": 80, "on": true}', '{"port": 80}', ""):
        assert not grade(checks, {"c.json": bad}).passed, bad
    assert grade(checks, {}).reason == "c.json is missing"


def test_schema_records() -> None:
    schema = {"type": "object", "properties": {"id": {"type": "integer"},
                                               "s": {"enum": ["a", "b"]}},
              "required": ["id", "s"], "additionalProperties": False}
    checks = {"kind": "schema_records", "path": "r.json", "schema": schema,
              "expected": [{"id": 1, "s": "a"}]}
    assert grade(checks, {"r.json": '[{"s": "a", "id": 1}]'}).passed
    assert "missing" in grade(checks, {"r.json": '[{"id": 1}]'}).reason
    assert "extra" in grade(checks, {"r.json": '[{"id": 1, "s": "a", "x": 0}]'}).reason
    assert "enum" in grade(checks, {"r.json": '[{"id": 1, "s": "c"}]'}).reason
    assert "integer" in grade(checks, {"r.json": '[{"id": true, "s": "a"}]'}).reason
    assert "differ" in grade(checks, {"r.json": '[{"id": 2, "s": "a"}]'}).reason
    assert not grade(checks, {"r.json": '{"id": 1, "s": "a"}'}).passed


def test_ini_lines_and_csv() -> None:
    ini = {"kind": "ini_equal", "path": "a.ini", "expected": {"s": {"k": "1"}}}
    assert grade(ini, {"a.ini": "[s]\nk=1\n"}).passed
    assert not grade(ini, {"a.ini": "[s]\nk = 2\n"}).passed
    assert not grade(ini, {"a.ini": "[s]\nk = 1\nk = 1\n"}).passed  # duplicate key
    lines = {"kind": "lines_equal", "path": "l.txt", "expected": ["a", "b"]}
    assert grade(lines, {"l.txt": "a  \nb\n\n"}).passed
    assert not grade(lines, {"l.txt": "a\na\nb\n"}).passed
    table = {"kind": "csv_equal", "path": "d.csv", "expected": [["h", "v"], ["x", "1"]]}
    assert grade(table, {"d.csv": "h,v\r\nx,1\r\n"}).passed
    assert not grade(table, {"d.csv": "h,v\nx;1\n"}).passed


def test_program_output_runs_the_final_program_on_every_case() -> None:
    checks = {"kind": "program_output", "path": "prog.py", "input_name": "in.txt",
              "cases": [{"input": "1 2", "expected": "3"}, {"input": "5 5", "expected": "10"}],
              "timeout_s": 5.0}
    good = "import sys\nprint(sum(int(x) for x in open(sys.argv[1]).read().split()))\n"
    assert grade(checks, {"prog.py": good}).passed
    assert grade(checks, {"prog.py": "print(3)\n"}).reason == "case 1: wrong output"
    assert "failed" in grade(checks, {"prog.py": "raise SystemExit(1)\n"}).reason
    assert run_program("while True: pass\n", "in.txt", "", timeout_s=0.5) is None


def test_unknown_kind_is_a_task_bug_not_a_failure() -> None:
    with pytest.raises(UnknownGraderError):
        grade({"kind": "nope"}, {})
