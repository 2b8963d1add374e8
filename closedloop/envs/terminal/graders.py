"""Hidden graders: decide task success from the final files and the grader's reference data.

Each grader kind re-parses the final files itself; nothing the agent wrote is trusted (not the
output of the visible ``check.py``, not any claim in ``finish``). ``grade(checks, files)``
dispatches on ``checks["kind"]``:

- ``json_equal``: ``path`` parses as JSON (duplicate keys rejected) and strictly equals
  ``expected``.
- ``schema_records``: ``path`` parses, every record validates against ``schema`` (this module's
  own validator) and the records strictly equal ``expected``.
- ``ini_equal``: ``path`` parses (strict ``configparser``: no duplicate sections or keys) and
  its sections and key/value pairs equal ``expected``.
- ``lines_equal``: the lines of ``path`` (right-stripped, trailing blank lines dropped) equal
  ``expected``.
- ``csv_equal``: the ``csv.reader`` rows of ``path`` (trailing empty rows dropped) equal
  ``expected``.
- ``env_equal``: ``path`` parses as a strict env file (``parse_env_strict``: every line that is
  not blank or a ``#`` comment is ``KEY=value`` with an upper-case key, an unquoted value without
  whitespace, no ``export``, no spaces around ``=``, no key twice) and its mapping equals
  ``expected``.
- ``program_output``: ``path`` is run in a fresh sandbox (the environment's) on each case's
  input (written as ``input_name``); stripped stdout must equal the case's ``expected``.

Strict equality: ``1``, ``1.0`` and ``true`` are three different values; dict key order is
ignored.
"""

from __future__ import annotations

import configparser
import csv
import io
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from closedloop.envs.terminal.sandbox import run_command
from closedloop.errors import DuplicateKeyError, UnknownGraderError

GRADERS_VERSION = "graders-v1"


@dataclass(frozen=True)
class GradeResult:
    """A grader's decision and a short reason (``"ok"`` when passed)."""

    passed: bool
    reason: str


def strict_equal(a: Any, b: Any) -> bool:
    """JSON-value equality that also compares types (bool, int and float are distinct)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(strict_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(strict_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(f"duplicate key {key!r}")
        out[key] = value
    return out


def loads_strict(text: str) -> Any:
    """``json.loads`` that rejects duplicate object keys (ambiguous JSON is not accepted)."""
    return json.loads(text, object_pairs_hook=_no_duplicates)


def _read(files: Mapping[str, str], path: str) -> str | None:
    text = files.get(path)
    return text if isinstance(text, str) else None


def grade_json_equal(checks: Mapping[str, Any], files: Mapping[str, str]) -> GradeResult:
    """The file parses as JSON and strictly equals the expected value."""
    text = _read(files, checks["path"])
    if text is None:
        return GradeResult(False, f"{checks['path']} is missing")
    try:
        value = loads_strict(text)
    except ValueError as exc:
        return GradeResult(False, f"invalid JSON: {exc}")
    if not strict_equal(value, checks["expected"]):
        return GradeResult(False, "parsed value differs from the expected value")
    return GradeResult(True, "ok")


_SCHEMA_TYPES: dict[str, Callable[[Any], bool]] = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
}


def schema_errors(record: Any, schema: Mapping[str, Any]) -> list[str]:
    """Return the violations of one record against the JSON-schema subset (empty if valid)."""
    if not isinstance(record, dict):
        return ["record is not an object"]
    props: Mapping[str, Any] = schema.get("properties", {})
    errors = [f"missing {k!r}" for k in schema.get("required", []) if k not in record]
    for key, value in record.items():
        prop = props.get(key)
        if prop is None:
            if schema.get("additionalProperties", True) is False:
                errors.append(f"extra field {key!r}")
            continue
        if "enum" in prop and not any(strict_equal(value, e) for e in prop["enum"]):
            errors.append(f"{key!r} not in enum")
        if "type" in prop and not _SCHEMA_TYPES[prop["type"]](value):
            errors.append(f"{key!r} is not {prop['type']}")
    return errors


def grade_schema_records(checks: Mapping[str, Any], files: Mapping[str, str]) -> GradeResult:
    """Records validate against the schema and strictly equal the expected records."""
    text = _read(files, checks["path"])
    if text is None:
        return GradeResult(False, f"{checks['path']} is missing")
    try:
        records = loads_strict(text)
    except ValueError as exc:
        return GradeResult(False, f"invalid JSON: {exc}")
    if not isinstance(records, list):
        return GradeResult(False, "records file is not a JSON array")
    for i, rec in enumerate(records):
        errors = schema_errors(rec, checks["schema"])
        if errors:
            return GradeResult(False, f"record {i}: {', '.join(errors)}")
    if not strict_equal(records, checks["expected"]):
        return GradeResult(False, "records differ from the expected records")
    return GradeResult(True, "ok")


def grade_ini_equal(checks: Mapping[str, Any], files: Mapping[str, str]) -> GradeResult:
    """The INI parses strictly and its sections/keys/values equal the expected mapping."""
    text = _read(files, checks["path"])
    if text is None:
        return GradeResult(False, f"{checks['path']} is missing")
    parser = configparser.ConfigParser(strict=True, interpolation=None)
    try:
        parser.read_string(text)
    except configparser.Error as exc:
        return GradeResult(False, f"INI does not parse: {type(exc).__name__}")
    got = {s: dict(parser.items(s)) for s in parser.sections()}
    if got != checks["expected"]:
        return GradeResult(False, "INI values differ from the expected values")
    return GradeResult(True, "ok")


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def grade_lines_equal(checks: Mapping[str, Any], files: Mapping[str, str]) -> GradeResult:
    """The file's lines equal the expected lines (trailing whitespace ignored)."""
    text = _read(files, checks["path"])
    if text is None:
        return GradeResult(False, f"{checks['path']} is missing")
    if _lines(text) != list(checks["expected"]):
        return GradeResult(False, "lines differ from the expected lines")
    return GradeResult(True, "ok")


def grade_csv_equal(checks: Mapping[str, Any], files: Mapping[str, str]) -> GradeResult:
    """The CSV rows equal the expected rows (trailing empty rows ignored)."""
    text = _read(files, checks["path"])
    if text is None:
        return GradeResult(False, f"{checks['path']} is missing")
    try:
        rows = list(csv.reader(io.StringIO(text, newline="")))
    except csv.Error as exc:
        return GradeResult(False, f"CSV does not parse: {exc}")
    while rows and not rows[-1]:
        rows.pop()
    if rows != [list(r) for r in checks["expected"]]:
        return GradeResult(False, "rows differ from the expected rows")
    return GradeResult(True, "ok")


_ENV_LINE = re.compile(r"([A-Z][A-Z0-9_]*)=([^\s\"']*)")


def parse_env_strict(text: str) -> dict[str, str]:
    """Parse a strict env file into KEY -> value; ``ValueError`` naming the first bad line.

    Lines are split on ``\n`` and right-stripped; blank lines and lines starting with ``#`` are
    skipped; every other line must fully match ``KEY=value`` (``KEY`` = ``[A-Z][A-Z0-9_]*``,
    ``value`` without whitespace or quotes) and no key may occur twice.
    """
    out: dict[str, str] = {}
    for n, raw in enumerate(text.split("\n"), 1):
        line = raw.rstrip()
        if not line or line.startswith("#"):
            continue
        m = _ENV_LINE.fullmatch(line)
        if m is None:
            raise ValueError(f"line {n} is not KEY=value")
        if m[1] in out:
            raise ValueError(f"line {n} sets {m[1]} a second time")
        out[m[1]] = m[2]
    return out


def grade_env_equal(checks: Mapping[str, Any], files: Mapping[str, str]) -> GradeResult:
    """The env file parses strictly and its variables equal the expected mapping."""
    text = _read(files, checks["path"])
    if text is None:
        return GradeResult(False, f"{checks['path']} is missing")
    try:
        got = parse_env_strict(text)
    except ValueError as exc:
        return GradeResult(False, f"env file does not parse: {exc}")
    if got != dict(checks["expected"]):
        return GradeResult(False, "variables differ from the expected values")
    return GradeResult(True, "ok")


def run_program(source: str, input_name: str, input_text: str, timeout_s: float) -> str | None:
    """Run ``source`` as ``prog.py`` on one input in a fresh sandbox; return stdout or ``None``.

    The program is untrusted agent code: it runs in the environment's sandbox
    (``closedloop.envs.terminal.sandbox.run_command``: audit hook, resource limits, private
    directory)
    with only ``prog.py`` and the input file. ``None`` means it crashed, timed out or its output
    was cut. A sandbox infrastructure failure raises ``SandboxInfraError`` (never a score).
    """
    result = run_command(["python3", "prog.py", input_name],
                         {"prog.py": source, input_name: input_text}, timeout_s=timeout_s)
    if result.timed_out or result.truncated or result.exit_code != 0:
        return None
    return result.stdout


def grade_program_output(checks: Mapping[str, Any], files: Mapping[str, str]) -> GradeResult:
    """The program prints the reference output on the visible and the hidden inputs."""
    source = _read(files, checks["path"])
    if source is None:
        return GradeResult(False, f"{checks['path']} is missing")
    for i, case in enumerate(checks["cases"]):
        out = run_program(source, checks["input_name"], case["input"],
                          float(checks.get("timeout_s", 5.0)))
        if out is None:
            return GradeResult(False, f"case {i}: program failed or timed out")
        if out.strip() != case["expected"]:
            return GradeResult(False, f"case {i}: wrong output")
    return GradeResult(True, "ok")


GRADERS: Mapping[str, Callable[[Mapping[str, Any], Mapping[str, str]], GradeResult]] = {
    "json_equal": grade_json_equal,
    "schema_records": grade_schema_records,
    "ini_equal": grade_ini_equal,
    "lines_equal": grade_lines_equal,
    "csv_equal": grade_csv_equal,
    "env_equal": grade_env_equal,
    "program_output": grade_program_output,
}


def grade(checks: Mapping[str, Any], files: Mapping[str, str]) -> GradeResult:
    """Dispatch on ``checks["kind"]``; ``UnknownGraderError`` for an unknown kind."""
    fn = GRADERS.get(str(checks.get("kind")))
    if fn is None:
        raise UnknownGraderError(f"no grader of kind {checks.get('kind')!r}")
    return fn(checks, files)
