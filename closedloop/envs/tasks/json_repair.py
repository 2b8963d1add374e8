"""``json-repair-v1``: a small JSON config file is broken; repair it.

Templates (the last one is held out):

- ``trailing-comma``: a comma after the last member; the file does not parse.
- ``wrong-type``: an integer value is stored as a string.
- ``missing-key``: a required key is absent; the objective gives its value.
- ``missing-quote``: a string value lost its closing quote; the file does not parse.

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
from closedloop.envs.tasks.base import TaskDraft, TemplateFamily

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


def _draft(rng: random.Random, path: str, expected: dict[str, Any], broken: str, objective: str,
           edit: Action) -> TaskDraft:
    types = {k: type(v).__name__ for k, v in expected.items()}
    return TaskDraft(
        objective=objective,
        initial_files={path: broken, "check.py": _CHECK.format(path=path, types=types),
                       "README.md": f"# Service\n\nThe service reads its settings from {path}.\n"},
        commands={"check": ("python3", "check.py")},
        protected_paths=("README.md",),
        validator_paths=("check.py",),
        checks={"kind": "json_equal", "path": path, "expected": expected},
        gold_actions=(Action.tool("read_file", path=path), edit,
                      Action.tool("run", command="check"), Action.finish()),
    )


def trailing_comma(rng: random.Random) -> TaskDraft:
    """A comma after the last member of the object."""
    path = rng.choice(_FILES)
    expected = _config(rng, ())
    good = _render(expected)
    last = good.rstrip("\n").split("\n")[-2]
    broken = good.replace(f"{last}\n}}", f"{last},\n}}")
    objective = (f"{path} is not valid JSON because of a trailing comma. Fix the syntax so it "
                 "parses, keeping every key and value unchanged. Run `check` to test it.")
    edit = Action.tool("replace", path=path, old=f"{last},\n}}", new=f"{last}\n}}")
    return _draft(rng, path, expected, broken, objective, edit)


def wrong_type(rng: random.Random) -> TaskDraft:
    """An integer value stored as a string."""
    path = rng.choice(_FILES)
    expected = _config(rng, (_INT_KEYS,))
    key = next(k for k in expected if k in _INT_KEYS)
    value = expected[key]
    good_line, bad_line = f'"{key}": {value}', f'"{key}": "{value}"'
    broken = _render(expected).replace(good_line, bad_line)
    objective = (f"In {path}, `{key}` must be an integer but is stored as a string. Make it the "
                 f"integer {value} and keep all other values unchanged. Run `check` to test it.")
    edit = Action.tool("replace", path=path, old=bad_line, new=good_line)
    return _draft(rng, path, expected, broken, objective, edit)


def missing_key(rng: random.Random) -> TaskDraft:
    """A required key is absent; the objective states its value."""
    path = rng.choice(_FILES)
    expected = _config(rng, ())
    key = rng.choice(list(expected))
    broken = _render({k: v for k, v in expected.items() if k != key})
    member = f'"{key}": {json.dumps(expected[key])}'
    objective = (f"{path} is missing the required key `{key}`. Add {member} and keep the other "
                 "keys and values unchanged. Run `check` to test it.")
    edit = Action.tool("write_file", path=path, content=_render(expected))
    return _draft(rng, path, expected, broken, objective, edit)


def missing_quote(rng: random.Random) -> TaskDraft:
    """A string value lost its closing quote."""
    path = rng.choice(_FILES)
    expected = _config(rng, (_STR_KEYS,))
    key = next(k for k in expected if k in _STR_KEYS)
    good_member = f'"{key}": "{expected[key]}"'
    bad_member = f'"{key}": "{expected[key]}'
    broken = _render(expected).replace(good_member, bad_member)
    objective = (f"{path} does not parse: a string value is missing its closing quote. Fix it so "
                 "the file is valid JSON with the intended values. Run `check` to test it.")
    # Replace through the following character (comma or newline) so ``old`` is unique.
    nxt = broken[broken.index(bad_member) + len(bad_member)]
    edit = Action.tool("replace", path=path, old=bad_member + nxt, new=good_member + nxt)
    return _draft(rng, path, expected, broken, objective, edit)


FAMILY = TemplateFamily(
    family_id=FAMILY_ID,
    builders={"trailing-comma": trailing_comma, "wrong-type": wrong_type,
              "missing-key": missing_key, "missing-quote": missing_quote},
    heldout_templates=("missing-quote",),
    description="Repair a small JSON config file.",
)
