"""``json-repair-v1``: a small JSON config file is broken; repair it.

Base templates (the last two are held out), each at the three hint levels of ``base``:

- ``trailing-comma``: a comma after the last member; the file does not parse.
- ``wrong-type``: an integer value is stored as a string.
- ``missing-key``: a required key is absent; ``README.md`` documents its value.
- ``unquoted-key``: a key lost its quotes; the file does not parse.
- ``missing-quote``: a string value lost its closing quote; the file does not parse.
- ``bool-as-string``: a boolean value is stored as the string ``"true"`` / ``"false"``.

Every gold edit is one single-line ``replace`` (``exact`` quotes its old and new text).

``README.md`` is a protected invariant. Hidden grader (``kind="json_equal"``): the final file
parses (duplicate keys rejected) and equals the expected value with strict types (``8080`` is
not ``"8080"``, ``1`` is not ``true``). The visible ``check.py`` only checks that the file parses
and that each key has the right type, so a wrong value passes it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

from closedloop.contracts import Action
from closedloop.envs.terminal.families.base import TaskDraft, TemplateFamily, shown

FAMILY_ID = "json-repair-v1"
_FILES = ("config.json", "settings.json", "service.json", "app.json")
_WORDS = ("alpha", "bravo", "delta", "ember", "falcon", "harbor", "juniper", "lumen", "orbit",
          "pixel", "quartz", "sierra", "tango", "vertex")
_FIELDS: dict[str, Callable[[random.Random], Any]] = {
    "name": lambda r: r.choice(_WORDS),
    "host": lambda r: r.choice(("localhost", "db.internal", "10.0.0.5", "api.local")),
    "mode": lambda r: r.choice(("fast", "safe", "batch", "debug")),
    "region": lambda r: r.choice(("eu-west", "us-east", "ap-south")),
    "port": lambda r: r.choice((80, 443, 5432, 6379, 8000, 8080, 9090)),
    "retries": lambda r: r.randint(1, 9),
    "workers": lambda r: r.randint(2, 16),
    "debug": lambda r: r.choice((True, False)),
    "timeout": lambda r: r.choice((0.5, 1.5, 2.5, 10.0)),
}
_STR_KEYS = ("name", "host", "mode", "region")
_INT_KEYS = ("port", "retries", "workers")

_CHECK = '''import json
import sys

PATH = {path!r}
TYPES = {types!r}
try:
    with open(PATH) as f:
        data = json.load(f)
except (OSError, ValueError) as exc:
    print(f"FAIL: {{PATH}} is not valid JSON: {{exc}}")
    sys.exit(1)
for key, tname in TYPES.items():
    if key not in data:
        print(f"FAIL: missing key {{key!r}}")
        sys.exit(1)
    if type(data[key]).__name__ != tname:
        print(f"FAIL: {{key!r}} should be {{tname}}, got {{type(data[key]).__name__}}")
        sys.exit(1)
print("OK")
'''


def _config(rng: random.Random, must: tuple[tuple[str, ...], ...]) -> dict[str, Any]:
    """Draw a 4-key config that contains one key of each group in ``must``."""
    keys: list[str] = []
    for group in must:
        keys.append(rng.choice([k for k in _FIELDS if k in group and k not in keys]))
    others = [k for k in _FIELDS if k not in keys]
    keys += rng.sample(others, 4 - len(keys))
    rng.shuffle(keys)
    return {k: _FIELDS[k](rng) for k in keys}


def _render(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2) + "\n"


def _draft(path: str, expected: dict[str, Any], broken: str, objectives: tuple[str, str, str],
           edit: Action, readme: str = "") -> TaskDraft:
    """objectives: (exact, located, symptom)."""
    types = {k: type(v).__name__ for k, v in expected.items()}
    exact, located, symptom = objectives
    return TaskDraft(
        objective=symptom,
        hints={"exact": exact, "located": located},
        initial_files={path: broken, "check.py": _CHECK.format(path=path, types=types),
                       "README.md": f"# Service\n\nThe service reads its settings from {path}.\n"
                                    + readme},
        commands={"check": ("python3", "check.py")},
        protected_paths=("README.md",),
        validator_paths=("check.py",),
        checks={"kind": "json_equal", "path": path, "expected": expected},
        gold_actions=(Action.tool("read_file", path=path), edit,
                      Action.tool("run", command="check"), Action.finish()),
    )


def _exact(path: str, old: str, new: str, why: str) -> str:
    return (f"In {path} replace `{shown(old)}` with `{shown(new)}` ({why}), run `check`, then "
            "finish.")


def _member(key: str, value: Any) -> str:
    return f'"{key}": {json.dumps(value)}'


def trailing_comma(rng: random.Random) -> TaskDraft:
    """A comma after the last member of the object."""
    path = rng.choice(_FILES)
    expected = _config(rng, ())
    last_key = list(expected)[-1]
    good_member = _member(last_key, expected[last_key])
    broken = _render(expected).replace(f"{good_member}\n}}", f"{good_member},\n}}")
    old, new = f"{good_member},", good_member
    objectives = (
        _exact(path, old, new, "the trailing comma after the last member"),
        f"{path} does not parse because its last member, `{last_key}`, is followed by a trailing "
        "comma before the closing brace. Remove that comma, keep every value, run `check`, then "
        "finish.",
        f"{path} fails to parse as JSON. Make it valid JSON with every key and value unchanged, "
        "run `check`, then finish.")
    return _draft(path, expected, broken, objectives, Action.tool("replace", path=path, old=old,
                                                                  new=new))


def wrong_type(rng: random.Random) -> TaskDraft:
    """An integer value stored as a string."""
    path = rng.choice(_FILES)
    expected = _config(rng, (_INT_KEYS,))
    key = next(k for k in expected if k in _INT_KEYS)
    value = expected[key]
    good, bad = f'"{key}": {value}', f'"{key}": "{value}"'
    broken = _render(expected).replace(good, bad)
    objectives = (
        _exact(path, bad, good, "an integer, not a string"),
        f"In {path}, `{key}` must be an integer but is stored as a string. Change its type "
        "without changing its value or any other key, run `check`, then finish.",
        f"`check` reports a type error in {path}. Fix {path} so `check` passes without changing "
        "any value, then finish.")
    return _draft(path, expected, broken, objectives, Action.tool("replace", path=path, old=bad,
                                                                  new=good))


def missing_key(rng: random.Random) -> TaskDraft:
    """A required key is absent; README.md documents its value."""
    path = rng.choice(_FILES)
    expected = _config(rng, ())
    key = rng.choice(list(expected)[1:])
    first = next(iter(expected))
    broken = _render({k: v for k, v in expected.items() if k != key})
    anchor = _member(first, expected[first]) + ","
    member = _member(key, expected[key])
    readme = f"\nRequired: `{key}` = {json.dumps(expected[key])}.\n"
    objectives = (
        _exact(path, anchor, f"{anchor} {member},", f"this adds the missing key `{key}`"),
        f"{path} lacks the required key `{key}`. Add it with the value README.md documents, keep "
        "the other keys unchanged, run `check`, then finish.",
        f"`check` fails on {path}. Fix {path} so it passes, with the values documented in "
        "README.md and no existing value changed, then finish.")
    edit = Action.tool("replace", path=path, old=anchor, new=f"{anchor} {member},")
    return _draft(path, expected, broken, objectives, edit, readme)


def missing_quote(rng: random.Random) -> TaskDraft:
    """A string value lost its closing quote."""
    path = rng.choice(_FILES)
    expected = _config(rng, (_STR_KEYS,))
    key = next(k for k in expected if k in _STR_KEYS)
    good_member = _member(key, expected[key])
    bad_member = good_member[:-1]
    broken = _render(expected).replace(good_member, bad_member)
    objectives = (
        _exact(path, bad_member, good_member, "the missing closing quote"),
        f"{path} does not parse because the string value of `{key}` lacks its closing quote. "
        "Add the quote without changing the value, run `check`, then finish.",
        f"{path} fails to parse as JSON. Make it valid JSON with the intended values, run "
        "`check`, then finish.")
    edit = Action.tool("replace", path=path, old=bad_member, new=good_member)
    return _draft(path, expected, broken, objectives, edit)


def unquoted_key(rng: random.Random) -> TaskDraft:
    """A key lost its double quotes."""
    path = rng.choice(_FILES)
    expected = _config(rng, ())
    key = rng.choice(list(expected))
    good = _member(key, expected[key])
    bad = f"{key}: {json.dumps(expected[key])}"
    broken = _render(expected).replace(good, bad)
    objectives = (
        _exact(path, bad, good, "quote the key"),
        f"{path} does not parse because the key `{key}` is not in double quotes. Quote it "
        "without changing its value, run `check`, then finish.",
        f"{path} fails to parse as JSON. Make it valid JSON with every key and value unchanged, "
        "run `check`, then finish.")
    return _draft(path, expected, broken, objectives, Action.tool("replace", path=path, old=bad,
                                                                  new=good))


def bool_as_string(rng: random.Random) -> TaskDraft:
    """A boolean value stored as a string."""
    path = rng.choice(_FILES)
    expected = _config(rng, (("debug",),))
    good = _member("debug", expected["debug"])
    bad = f'"debug": "{json.dumps(expected["debug"])}"'
    broken = _render(expected).replace(good, bad)
    objectives = (
        _exact(path, bad, good, "a boolean, not a string"),
        f"In {path}, `debug` must be a boolean but is stored as a string. Change its type "
        "without changing its value or any other key, run `check`, then finish.",
        f"`check` reports a type error in {path}. Fix {path} so `check` passes without changing "
        "any value, then finish.")
    return _draft(path, expected, broken, objectives, Action.tool("replace", path=path, old=bad,
                                                                  new=good))


FAMILY = TemplateFamily(
    family_id=FAMILY_ID,
    builders={"trailing-comma": trailing_comma, "wrong-type": wrong_type,
              "missing-key": missing_key, "unquoted-key": unquoted_key,
              "missing-quote": missing_quote, "bool-as-string": bool_as_string},
    heldout_templates=("missing-quote", "bool-as-string"),
    description="Repair a small JSON config file.",
)
