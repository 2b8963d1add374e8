"""``schema-repair-v1``: a JSON records file violates a JSON-schema-like spec; fix the records.

``schema.json`` (protected) describes one record with a subset of JSON Schema: ``type: object``,
``properties`` with ``type`` (``integer``, ``number``, ``string``) or ``enum``, ``required`` and
``additionalProperties: false``. ``records.json`` holds three records, one per line; exactly one
record breaks the schema.

Templates (the last two are held out):

- ``wrong-type``: an integer field is stored as a string.
- ``missing-field``: a required field is absent; ``README.md`` (protected) gives its value.
- ``extra-field``: a record carries a field the schema does not allow.
- ``misspelled-key``: a record's field name is misspelt (two letters swapped), so a required
  field is missing and an unknown one is present.
- ``enum-value``: an enum field holds a misspelling of an allowed value.
- ``float-for-int``: an integer field holds a float with a zero fraction (``12.0``).

Every template is posed at the three hint levels of ``base``; every gold edit is one
single-line ``replace`` (``exact`` quotes it).

Hidden grader (``kind="schema_records"``): the final records validate against the schema (the
grader's own validator) and equal the expected records with strict types. The visible
``check.py`` validates against ``schema.json`` only, so a changed value passes it.
"""

from __future__ import annotations

import json
import random
from typing import Any

from closedloop.contracts import Action
from closedloop.envs.terminal.families.base import TaskDraft, TemplateFamily, shown

FAMILY_ID = "schema-repair-v1"
_NAMES = ("ada", "bo", "cyd", "dee", "eli", "fay", "gus", "hal", "ivy", "jo", "kai", "lu")
_ENUMS = (("active", "paused", "closed"), ("new", "open", "done"), ("low", "medium", "high"))
_ENUM_KEYS = ("status", "state", "level")
_INT_KEYS = ("qty", "age", "rank")
_EXTRA = (("note", '"tmp"'), ("debug", "true"), ("legacy_id", "0"))

_CHECK = '''import json
import sys

schema = json.load(open("schema.json"))
try:
    records = json.load(open("records.json"))
except (OSError, ValueError) as exc:
    print(f"FAIL: records.json is not valid JSON: {exc}")
    sys.exit(1)
TYPES = {"integer": int, "number": (int, float), "string": str}
errors = []
for i, rec in enumerate(records):
    for key in schema["required"]:
        if key not in rec:
            errors.append(f"record {i}: missing required field {key!r}")
    for key, value in rec.items():
        prop = schema["properties"].get(key)
        if prop is None:
            errors.append(f"record {i}: field {key!r} is not allowed")
        elif "enum" in prop and value not in prop["enum"]:
            errors.append(f"record {i}: {key!r}={value!r} is not one of {prop['enum']}")
        elif "type" in prop and (isinstance(value, bool)
                                 or not isinstance(value, TYPES[prop["type"]])):
            errors.append(f"record {i}: {key!r} should be {prop['type']}")
if errors:
    print("FAIL: " + "; ".join(errors))
    sys.exit(1)
print("OK")
'''


def _schema(rng: random.Random) -> tuple[dict[str, Any], str, str, tuple[str, ...]]:
    """Return (schema, enum key, int key, enum values)."""
    e = rng.randrange(len(_ENUMS))
    enum_key, int_key, enum = _ENUM_KEYS[e], rng.choice(_INT_KEYS), _ENUMS[e]
    schema = {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                       int_key: {"type": "integer"}, enum_key: {"enum": list(enum)}},
        "required": ["id", "name", int_key, enum_key],
        "additionalProperties": False,
    }
    return schema, enum_key, int_key, enum


def _records(rng: random.Random, int_key: str, enum_key: str,
             enum: tuple[str, ...]) -> list[dict[str, Any]]:
    ids = sorted(rng.sample(range(1, 60), 3))
    names = rng.sample(_NAMES, 3)
    return [{"id": i, "name": n, int_key: rng.randint(1, 40), enum_key: rng.choice(enum)}
            for i, n in zip(ids, names, strict=True)]


def _render(records: list[dict[str, Any]]) -> str:
    return "[\n" + ",\n".join("  " + json.dumps(r) for r in records) + "\n]\n"


def _render_schema(schema: dict[str, Any]) -> str:
    props = ",\n".join(f"    {json.dumps(k)}: {json.dumps(v)}"
                        for k, v in schema["properties"].items())
    return (f'{{\n  "type": "object",\n  "properties": {{\n{props}\n  }},\n'
            f'  "required": {json.dumps(schema["required"])},\n'
            '  "additionalProperties": false\n}\n')


_SYMPTOM = ("`check` fails on records.json. Fix the records, not schema.json, then finish.")


def _draft(schema: dict[str, Any], expected: list[dict[str, Any]], broken: str, located: str,
           edit: Action, why: str, readme: str | None = None,
           symptom: str = _SYMPTOM) -> TaskDraft:
    """``located``: what is wrong where (one clause); ``why``: the exact edit's purpose."""
    old, new = str(edit.args["old"]), str(edit.args["new"])
    files = {"records.json": broken, "schema.json": _render_schema(schema), "check.py": _CHECK}
    if readme is not None:
        files["README.md"] = readme
    return TaskDraft(
        objective=symptom,
        hints={"exact": (f"In records.json replace `{shown(old)}` with `{shown(new)}` ({why}), "
                         "run `check`, then finish."),
               "located": (f"In records.json, {located}. Fix that record without changing "
                           "schema.json or any other value, run `check`, then finish.")},
        initial_files=files,
        commands={"check": ("python3", "check.py")},
        protected_paths=("schema.json", *(("README.md",) if readme is not None else ())),
        validator_paths=("check.py",),
        checks={"kind": "schema_records", "path": "records.json", "schema": schema,
                "expected": expected},
        gold_actions=(Action.tool("read_file", path="records.json"), edit,
                      Action.tool("run", command="check"), Action.finish()),
    )


def _setup(rng: random.Random) -> tuple[dict[str, Any], str, str, tuple[str, ...],
                                        list[dict[str, Any]], int]:
    schema, enum_key, int_key, enum = _schema(rng)
    records = _records(rng, int_key, enum_key, enum)
    return schema, enum_key, int_key, enum, records, rng.randrange(len(records))


def wrong_type(rng: random.Random) -> TaskDraft:
    """An integer field stored as a string."""
    schema, _, int_key, _, records, k = _setup(rng)
    rec = records[k]
    good, bad = f'"{int_key}": {rec[int_key]}', f'"{int_key}": "{rec[int_key]}"'
    line = json.dumps(rec)
    broken = _render(records).replace(line, line.replace(good, bad))
    located = f"the record with id {rec['id']} stores `{int_key}` as a string, not an integer"
    edit = Action.tool("replace", path="records.json", old=bad, new=good)
    return _draft(schema, records, broken, located, edit, "an integer, not a string")


def missing_field(rng: random.Random) -> TaskDraft:
    """A required field is absent; its value is given in the objective."""
    schema, enum_key, _, _, records, k = _setup(rng)
    rec = records[k]
    short = {key: v for key, v in rec.items() if key != enum_key}
    broken = _render([short if i == k else r for i, r in enumerate(records)])
    located = (f"the record with id {rec['id']} lacks the required field `{enum_key}` (README.md "
               "gives its value)")
    last = list(short)[-1]
    tail = f'"{last}": {json.dumps(short[last])}}}'  # the record's last member: unique
    edit = Action.tool("replace", path="records.json", old=tail,
                       new=f"{tail[:-1]}, \"{enum_key}\": \"{rec[enum_key]}\"}}")
    readme = (f"# records.json\n\nThe record with id {rec['id']} ({rec['name']}) has "
              f"{enum_key} \"{rec[enum_key]}\".\n")
    return _draft(schema, records, broken, located, edit, "add the missing field", readme,
                  symptom=_SYMPTOM.replace("Fix the records", "Fix the records (README.md "
                                           "documents them)"))


def extra_field(rng: random.Random) -> TaskDraft:
    """A record has a field that ``additionalProperties: false`` forbids."""
    schema, _, _, _, records, k = _setup(rng)
    rec = records[k]
    key, raw = rng.choice(_EXTRA)
    line = json.dumps(rec)
    bad_line = line[:-1] + f', "{key}": {raw}}}'
    broken = _render(records).replace(line, bad_line)
    located = (f"the record with id {rec['id']} has the field `{key}`, which schema.json does "
               "not allow")
    last = f'"{list(rec)[-1]}": {json.dumps(rec[list(rec)[-1]])}'
    edit = Action.tool("replace", path="records.json", old=f'{last}, "{key}": {raw}}}',
                       new=f"{last}}}")
    return _draft(schema, records, broken, located, edit, "drop the field the schema forbids")


def enum_value(rng: random.Random) -> TaskDraft:
    """An enum field holds a misspelling (one letter dropped) of an allowed value."""
    schema, enum_key, _, _, records, k = _setup(rng)
    rec = records[k]
    value = rec[enum_key]
    cut = rng.randrange(1, len(value))
    typo = value[:cut] + value[cut + 1:]
    good, bad = f'"{enum_key}": "{value}"', f'"{enum_key}": "{typo}"'
    line = json.dumps(rec)
    broken = _render(records).replace(line, line.replace(good, bad))
    located = (f"the `{enum_key}` of the record with id {rec['id']} is a misspelling of one of "
               "the values schema.json allows")
    edit = Action.tool("replace", path="records.json", old=bad, new=good)
    return _draft(schema, records, broken, located, edit, "the allowed value it misspells")


def misspelled_key(rng: random.Random) -> TaskDraft:
    """A field name has two adjacent letters swapped (``nmae`` for ``name``)."""
    schema, enum_key, int_key, _, records, k = _setup(rng)
    rec = records[k]
    key = rng.choice(["name", int_key, enum_key])
    cut = rng.randrange(len(key) - 1)
    while key[cut] == key[cut + 1]:
        cut = (cut + 1) % (len(key) - 1)
    typo = key[:cut] + key[cut + 1] + key[cut] + key[cut + 2:]
    good = f'"{key}": {json.dumps(rec[key])}'
    bad = f'"{typo}": {json.dumps(rec[key])}'
    line = json.dumps(rec)
    broken = _render(records).replace(line, line.replace(good, bad))
    located = (f"the record with id {rec['id']} has the field `{typo}`, a misspelling of the "
               f"schema's `{key}`")
    edit = Action.tool("replace", path="records.json", old=bad, new=good)
    return _draft(schema, records, broken, located, edit, "the field name schema.json uses")


def float_for_int(rng: random.Random) -> TaskDraft:
    """An integer field holds a float with a zero fraction."""
    schema, _, int_key, _, records, k = _setup(rng)
    rec = records[k]
    good, bad = f'"{int_key}": {rec[int_key]}', f'"{int_key}": {rec[int_key]}.0'
    line = json.dumps(rec)
    broken = _render(records).replace(line, line.replace(good, bad))
    located = (f"the record with id {rec['id']} stores `{int_key}` as a float, not the integer "
               "schema.json requires")
    edit = Action.tool("replace", path="records.json", old=bad, new=good)
    return _draft(schema, records, broken, located, edit, "an integer, not a float")


FAMILY = TemplateFamily(
    family_id=FAMILY_ID,
    builders={"wrong-type": wrong_type, "missing-field": missing_field,
              "extra-field": extra_field, "misspelled-key": misspelled_key,
              "enum-value": enum_value, "float-for-int": float_for_int},
    heldout_templates=("enum-value", "float-for-int"),
    description="Make a JSON records file satisfy a JSON-schema-like spec.",
)
