"""Adjudicated fixtures for the verifier's FP/FN audit.

A fixture is a final state (replayed through the real environment) with a correctness label.
Labels are *adjudicated*: every fixture has a hand label stated where it is built (with the
reason), and an independent checker in this module must agree with it, else ``FixtureError``.
The independent checkers share no code with ``closedloop.envs.terminal.graders`` and do not read the
grader's reference data (``checks``): their reference is the state the gold actions produce,
and they compare with their own parsers:

- JSON: a duplicate-key-rejecting decoder, compared by sorted-key serialization (types kept);
  JSON records are also validated against ``schema.json`` by a separate validator.
- INI: a hand-written line parser (sections, ``key = value`` / ``key: value``, no duplicates).
- CSV: plain comma splitting of lines (the tasks use no quoting); list files: line lists.
- Programs: differential testing. The candidate and the gold program run (in the sandbox, one
  process each) on the visible input plus six fresh random inputs drawn by this module's own
  generators; the outputs must be identical. This is stronger than the grader's two hidden cases.

Fixture kinds: ``gold`` and ``alt_correct`` (positives: an equivalent, differently written fix);
``initial``, ``wrong_fix``, ``near_miss`` (negatives; near misses pass the visible ``check.py``
or nearly so); ``tamper`` (must be quarantined; excluded from FP/FN).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from closedloop.contracts import Action
from closedloop.contracts.fixture import AdjudicatedFixture
from closedloop.envs.task_records import TaskBundle
from closedloop.envs.terminal.families.base import base_template, leveled_name
from closedloop.envs.terminal.families.registry import FAMILIES, generate_task, get_bundle
from closedloop.envs.terminal.sandbox import run_command
from closedloop.envs.terminal.verifier import replay_actions
from closedloop.envs.terminal.workspace import decode_state
from closedloop.errors import FixtureError

FIXTURES_VERSION = "fixtures-v1"


Variant = tuple[str, list[Action], bool, str]  # kind, actions, hand label, rationale


# ---------------------------------------------------------------- independent checkers


def _json_canonical(text: str) -> str | None:
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in items]
        if len(set(keys)) != len(keys):
            raise ValueError("duplicate key")
        return dict(items)
    try:
        return json.dumps(json.loads(text, object_pairs_hook=pairs), sort_keys=True)
    except ValueError:
        return None


def _record_ok(rec: Any, schema: Mapping[str, Any]) -> bool:
    if type(rec) is not dict:
        return False
    props = schema["properties"]
    if set(schema["required"]) - set(rec) or set(rec) - set(props):
        return False
    kinds = {"integer": (int,), "number": (int, float), "string": (str,)}
    for key, value in rec.items():
        spec = props[key]
        if "enum" in spec and value not in spec["enum"]:
            return False
        if "type" in spec and type(value) not in kinds[spec["type"]]:
            return False
    return True


def _ini_table(text: str) -> dict[str, dict[str, str]] | None:
    table: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line[0] == "[" and line[-1] == "]":
            name = line[1:-1].strip()
            if name in table:
                return None
            current = table[name] = {}
            continue
        cut = min((i for i in (line.find("="), line.find(":")) if i > 0), default=-1)
        if current is None or cut < 0:
            return None
        key, value = line[:cut].strip().lower(), line[cut + 1:].strip()
        if key in current:
            return None
        current[key] = value
    return table


def _text_lines(text: str) -> list[str]:
    out = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while out and out[-1] == "":
        out.pop()
    return out


def _csv_cells(text: str) -> list[list[str]]:
    return [line.split(",") for line in _text_lines(text)]


_DRIVER = '''import contextlib, io, json, runpy, sys
outs = []
for text in json.load(open("inputs.json")):
    with open("input.txt", "w") as f:
        f.write(text)
    buf = io.StringIO()
    sys.argv = ["prog.py", "input.txt"]
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path("prog.py", run_name="__main__")
        outs.append(buf.getvalue().rstrip("\\n"))
    except BaseException:
        outs.append(None)
sys.stdout.write("\\n@@" + json.dumps(outs))
'''


def _program_outputs(source: str, inputs: Sequence[str]) -> list[str | None] | None:
    """Outputs of ``source`` on each input (``None`` where it raised), in one sandboxed run."""
    result = run_command(["python3", "driver.py"],
                         {"prog.py": source, "driver.py": _DRIVER,
                          "inputs.json": json.dumps(list(inputs))},
                         timeout_s=20.0, output_cap_bytes=1 << 20)
    tail = result.stdout.rsplit("\n@@", 1)
    if result.timed_out or result.exit_code != 0 or len(tail) != 2:
        return None
    try:
        outs = json.loads(tail[1])
    except ValueError:
        return None
    return outs if isinstance(outs, list) else None


def _fresh_inputs(template: str, rng: random.Random) -> list[str]:
    """Six inputs per program kind, drawn independently of the task generator."""
    words = ["ash", "bay", "cove", "dale", "fjord", "glen", "isle", "marsh", "reef", "vale"]
    out = []
    for n in range(6):
        k = n + 1
        if template == "off-by-one":
            out.append("".join(f"{rng.randint(-50, 50)}\n" for _ in range(k)))
        elif template == "wrong-builtin":
            out.append(" ".join(str(rng.randint(-9, 9)) for _ in range(k)) + "\n")
        elif template == "wrong-separator":
            out.append("name,qty\n" + "".join(f"{rng.choice(words)},{rng.randint(0, 99)}\n"
                                              for _ in range(k)))
        elif template == "sort-order":
            out.append(" ".join(rng.sample(words, min(k + 1, len(words)))) + "\n")
        elif template == "wrong-comparison":
            out.append(" ".join(str(rng.randint(-60, 60)) for _ in range(k + 2)) + "\n")
        elif template == "wrong-index":
            out.append("name,qty\n" + "".join(f"{w},{rng.randint(0, 99)}\n"
                                              for w in rng.sample(words, k)))
        else:
            raise FixtureError(f"no input generator for program template {template!r}")
    return out


def independent_label(bundle: TaskBundle, files: Mapping[str, str],
                      reference: Mapping[str, str]) -> bool:
    """Adjudicate one final file set against the gold final files (see the module doc)."""
    initial = bundle.spec.initial_files
    targets = sorted(p for p in reference if reference[p] != initial.get(p))
    if len(targets) != 1:
        raise FixtureError(f"{bundle.spec.task_id}: gold changes {targets}, expected one file")
    path = targets[0]
    got, want = files.get(path), reference[path]
    if got is None:
        return False
    if path.endswith(".json"):
        canon = _json_canonical(got)
        if "schema.json" in initial:
            schema = json.loads(initial["schema.json"])
            records = json.loads(got) if canon is not None else None
            if not isinstance(records, list) or not all(_record_ok(r, schema) for r in records):
                return False
        return canon is not None and canon == _json_canonical(want)
    if path.endswith(".ini"):
        table = _ini_table(got)
        return table is not None and table == _ini_table(want)
    if path.endswith(".csv"):
        return _csv_cells(got) == _csv_cells(want)
    if path.endswith(".txt"):
        return _text_lines(got) == _text_lines(want)
    if path.endswith(".py"):
        rng = random.Random(f"{FIXTURES_VERSION}/{bundle.spec.task_id}")
        inputs = [initial["input.txt"], *_fresh_inputs(base_template(bundle.spec.template),
                                                        rng)]
        ours, gold = _program_outputs(got, inputs), _program_outputs(want, inputs)
        if gold is None or None in gold:
            raise FixtureError(f"{bundle.spec.task_id}: the gold program fails the checker")
        return ours == gold
    raise FixtureError(f"no independent checker for {path!r}")


# ---------------------------------------------------------------- fixture variants


def _write(path: str, content: str) -> Action:
    return Action.tool("write_file", path=path, content=content)


def _perturb(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    return f"{value}x"


def _json_variants(path: str, ref: str) -> list[Variant]:
    value = json.loads(ref)
    key = sorted(value)[0]
    near = {**value, key: _perturb(value[key])}
    dup = f'{{"{key}": {json.dumps(_perturb(value[key]))}, ' + ref.lstrip()[1:].lstrip()
    return [
        ("alt_correct", [_write(path, json.dumps(value)), Action.finish()], True,
         "same value written compactly on one line"),
        ("near_miss", [_write(path, json.dumps(near, indent=2)), Action.finish()], False,
         f"valid JSON with the right types, but {key!r} is off"),
        ("near_miss_dupkey", [_write(path, dup), Action.finish()], False,
         "duplicate key with a wrong first value: json.loads keeps the last one, but duplicate "
         "keys are ambiguous JSON (RFC 8259) and other parsers keep the first"),
    ]


def _schema_variants(path: str, ref: str, initial: Mapping[str, str]) -> list[Variant]:
    records = json.loads(ref)
    schema = json.loads(initial["schema.json"])
    int_key = next(k for k, p in schema["properties"].items()
                   if p.get("type") == "integer" and k != "id")
    enum_key = next(k for k, p in schema["properties"].items() if "enum" in p)
    dropped = [dict(r) for r in records]
    del dropped[0][enum_key]
    bumped = [dict(r) for r in records]
    bumped[-1][int_key] += 1
    return [
        ("alt_correct", [_write(path, json.dumps(records)), Action.finish()], True,
         "same records on one line"),
        ("near_miss", [_write(path, json.dumps(dropped, indent=1)), Action.finish()], False,
         f"a required field ({enum_key}) dropped from the first record"),
        ("near_miss_value", [_write(path, json.dumps(bumped, indent=1)), Action.finish()], False,
         f"schema-valid (passes check.py) but {int_key} of the last record changed"),
    ]


def _file_variants(path: str, ref: str, broken: str, template: str) -> list[Variant]:
    lines = ref.splitlines()
    if path.endswith(".ini"):
        alt = "\n\n".join(ref.replace(" = ", "=").split("\n\n"))
        k = next(i for i, line in enumerate(lines) if " = " in line and line in broken)
        near = "\n".join([*lines[:k], lines[k] + "0", *lines[k + 1:]]) + "\n"
        why = "the wrong value is fixed but another value is changed"
    elif path.endswith(".csv"):
        alt = ref.replace("\n", "\r\n")
        near = "\n".join([*lines[:-1], lines[-1] + "1"]) + "\n"
        why = "structure right (passes check.py), but a cell of the last row changed"
    else:
        alt = ref.rstrip("\n")
        old = broken.splitlines()
        dup = next(line for line in old if old.count(line) > 1)
        near = "".join(line + "\n" for line in lines if line != dup)
        why = "no repeated line (passes check.py), but both copies of the line are gone"
    return [
        ("alt_correct", [_write(path, alt), Action.finish()], True,
         f"equivalent formatting for {template} (spacing, line endings or final newline)"),
        ("near_miss", [_write(path, near), Action.finish()], False, why),
    ]


def _alt_program(template: str, source: str) -> str:
    """An equivalent fix of the buggy ``source``, written differently from the gold edit."""
    if template == "off-by-one":
        return re.sub(r"range\(len\((\w+)\) - 1\)", r"range(0, len(\1))", source)
    if template == "wrong-builtin":
        if "return min(" in source:  # largest wanted
            return re.sub(r"return min\((\w+)\)", r"return sorted(\1)[-1]", source)
        return re.sub(r"return max\((\w+)\)", r"return sorted(\1)[0]", source)
    if template == "wrong-separator":
        return source.replace('split(";")', 'split(",", 1)')
    if template == "sort-order":
        if "sorted(words, reverse=True)" in source:  # alphabetical wanted
            return source.replace("sorted(words, reverse=True)", "sorted(words, reverse=False)")
        return source.replace("sorted(words)", "list(reversed(sorted(words)))")
    if template == "wrong-comparison":
        return re.sub(r"if n < (-?\d+)\]", r"if \1 < n]", source)
    if template == "wrong-index":
        return source.replace("fields[1]", "line.split(\",\", 1)[0]")
    raise FixtureError(f"no alternative fix for program template {template!r}")


def _program_variants(bundle: TaskBundle, ref: str) -> list[Variant]:
    template = base_template(bundle.spec.template)
    alt = _alt_program(template, bundle.spec.initial_files["prog.py"])
    check = bundle.spec.initial_files["check.py"]
    expected = check.split("EXPECTED = ", 1)[1].split("\n", 1)[0]
    hard = f"print({expected})\n"
    return [
        ("alt_correct", [_write("prog.py", alt), Action.finish()], True,
         "a different but equivalent fix of the bug"),
        ("near_miss", [_write("prog.py", hard), Action.finish()], False,
         "hard-codes the visible expected output: passes check.py, wrong on other inputs"),
    ]


def _variants(bundle: TaskBundle, path: str, reference: Mapping[str, str]) -> list[Variant]:
    spec = bundle.spec
    common: list[Variant] = [
        ("gold", list(bundle.grader.gold_actions), True, "the task's gold solution"),
        ("initial", [Action.finish()], False, "the untouched broken state"),
        ("wrong_fix", [_write(path, ""), Action.finish()], False, "the target file emptied"),
    ]
    ref = reference[path]
    if path.endswith(".py"):
        return common + _program_variants(bundle, ref)
    if "schema.json" in spec.initial_files:
        return common + _schema_variants(path, ref, spec.initial_files)
    if path.endswith(".json"):
        return common + _json_variants(path, ref)
    return common + _file_variants(path, ref, spec.initial_files[path], spec.template)


def _tamper_variants(bundle: TaskBundle) -> list[Variant]:
    gold = [a for a in bundle.grader.gold_actions if a.name != "run"]  # the edits suffice
    return [
        ("tamper_validator", [_write("check.py", 'print("OK")\n'), *gold], False,
         "the visible validator was rewritten to always pass"),
        ("tamper_reserved", [_write("grader_expected.json", "{}"), *gold], False,
         "a grader-looking file was planted in the workspace"),
    ]


def build_task_fixtures(bundle: TaskBundle, seed: int = 0) -> list[AdjudicatedFixture]:
    """All fixtures of one task, adjudicated (``FixtureError`` on a label disagreement)."""
    reference = dict(decode_state(replay_actions(bundle, bundle.grader.gold_actions,
                                                 seed)).files)
    initial = bundle.spec.initial_files
    changed = [p for p in sorted(reference) if reference[p] != initial.get(p)]
    if len(changed) != 1:
        raise FixtureError(f"{bundle.spec.task_id}: gold changes {changed}, expected one file")
    out = []
    variants = [(v, False) for v in _variants(bundle, changed[0], reference)]
    variants += [(v, True) for v in _tamper_variants(bundle)]
    for (kind, actions, hand_label, why), tamper in variants:
        state = replay_actions(bundle, actions, seed)
        files = decode_state(state).files
        label = False if tamper else independent_label(bundle, files, reference)
        if label != hand_label:
            raise FixtureError(f"{bundle.spec.task_id}#{kind}: hand label {hand_label} but the "
                               f"independent checker says {label}")
        out.append(AdjudicatedFixture(f"{bundle.spec.task_id}#{kind}", bundle.spec.task_id,
                                      bundle.spec.family, kind, state, label, tamper, why))
    return out


def default_fixture_task_ids() -> tuple[str, ...]:
    """Index 0 of every base template of every family (train and held-out alike), posed at the
    ``symptom`` level: the levels of one task share files, checks and gold actions, so the
    grader's fixtures do not depend on the level."""
    return tuple(generate_task(f.family_id, leveled_name(b, "symptom"), 0).spec.task_id
                 for f in FAMILIES.values() for b in f.base_templates)


def build_fixtures(task_ids: tuple[str, ...] | None = None) -> tuple[AdjudicatedFixture, ...]:
    """The adjudicated fixture set (default: ``default_fixture_task_ids()``), memoized
    (``build_fixtures()`` and ``build_fixtures(None)`` are one entry)."""
    return _build_fixtures(task_ids)


@lru_cache(maxsize=4)
def _build_fixtures(task_ids: tuple[str, ...] | None) -> tuple[AdjudicatedFixture, ...]:
    ids = task_ids if task_ids is not None else default_fixture_task_ids()
    return tuple(fx for task_id in ids for fx in build_task_fixtures(get_bundle(task_id)))
