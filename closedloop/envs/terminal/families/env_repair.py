"""``env-repair-v1``: a service's env file (``KEY=value`` lines) has one defect; fix it.

The family-disjoint held-out family: it is registered in ``registry.HELDOUT_FAMILIES``, never in
``FAMILIES``, so no template of it is ever trained on (all six are held out). The workspace holds
the env file (``app.env``, ``service.env`` or ``worker.env``), ``README.md`` (protected: the
format rules and every variable's documented value) and ``check.py``, which checks the format
and that every documented variable is set, not the values.

Templates, each at the three hint levels of ``base`` (every gold edit is one ``replace``):

- ``spaced-equals``: one line has spaces around ``=``.
- ``lowercase-key``: one variable's name is in lower case.
- ``missing-var``: a documented variable is absent; README.md gives its value.
- ``duplicate-var``: a variable is set twice, once to the documented value and once not.
- ``quoted-value``: one value is wrapped in double quotes.
- ``export-prefix``: one line starts with ``export``.

Hidden grader (``kind="env_equal"``, ``closedloop.envs.terminal.graders.parse_env_strict``): the
final
file parses strictly and its variables equal the documented ones.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from closedloop.contracts import Action
from closedloop.envs.terminal.families.base import TaskDraft, TemplateFamily, shown

FAMILY_ID = "env-repair-v1"
_FILES = ("app.env", "service.env", "worker.env")
_VARS: dict[str, tuple[str, ...]] = {
    "PORT": ("80", "8080", "8443", "9000"),
    "DB_HOST": ("localhost", "db.internal", "10.0.0.7"),
    "DB_NAME": ("shop", "ledger", "notes"),
    "LOG_LEVEL": ("info", "debug", "warning"),
    "WORKERS": ("2", "4", "8"),
    "API_URL": ("http://api.local/v1", "https://api.example.test/v2"),
    "CACHE_TTL": ("60", "300", "3600"),
    "REGION": ("eu-west", "us-east", "ap-south"),
}

_CHECK = '''import re
import sys

PATH = {path!r}
REQUIRED = {required!r}
LINE = re.compile(r"([A-Z][A-Z0-9_]*)=([^\\s\\"']*)")
seen = {{}}
for n, raw in enumerate(open(PATH).read().split("\\n"), 1):
    line = raw.rstrip()
    if not line or line.startswith("#"):
        continue
    m = LINE.fullmatch(line)
    if m is None:
        print(f"FAIL: {{PATH}} line {{n}} is not KEY=value: {{line!r}}")
        sys.exit(1)
    if m[1] in seen:
        print(f"FAIL: {{PATH}} line {{n}} sets {{m[1]}} a second time")
        sys.exit(1)
    seen[m[1]] = m[2]
missing = [k for k in REQUIRED if k not in seen]
if missing:
    print(f"FAIL: {{PATH}} does not set {{missing}}")
    sys.exit(1)
print("OK")
'''


def _setup(rng: random.Random) -> tuple[str, dict[str, str], str]:
    """(path, documented variables in file order, the variable the defect is in)."""
    path = rng.choice(_FILES)
    names = rng.sample(sorted(_VARS), 5)
    env = {k: rng.choice(_VARS[k]) for k in names}
    return path, env, rng.choice(names[1:])


def _render(env: dict[str, str]) -> str:
    return "# service settings\n" + "".join(f"{k}={v}\n" for k, v in env.items())


def _readme(path: str, env: dict[str, str]) -> str:
    return (f"# {path}\n\nOne `KEY=value` per line: upper-case names, no spaces around `=`, no "
            "quotes, no `export`, each variable once. Documented values:\n\n"
            + "".join(f"- {k} = {v}\n" for k, v in env.items()))


def _draft(path: str, env: dict[str, str], broken: str, old: str, new: str, why: str,
           located: str, symptom: str) -> TaskDraft:
    return TaskDraft(
        objective=symptom,
        hints={"exact": (f"In {path} replace `{shown(old)}` with `{shown(new)}` ({why}), run "
                         "`check`, then finish."),
               "located": located},
        initial_files={path: broken, "README.md": _readme(path, env),
                       "check.py": _CHECK.format(path=path, required=list(env))},
        commands={"check": ("python3", "check.py")},
        protected_paths=("README.md",), validator_paths=("check.py",),
        checks={"kind": "env_equal", "path": path, "expected": dict(env)},
        gold_actions=(Action.tool("read_file", path=path),
                      Action.tool("replace", path=path, old=old, new=new),
                      Action.tool("run", command="check"), Action.finish()),
    )


def _format_symptom(path: str) -> str:
    return (f"`check` rejects the format of {path}. Fix {path} so it follows the rules in "
            "README.md without changing any value, then finish.")


def _line_defect(rng: random.Random, bad_line: Callable[[str, str], str], why: str,
                 what: str) -> TaskDraft:
    """One line of the file rewritten by ``bad_line(key, value)``; ``what``: the located clause."""
    path, env, key = _setup(rng)
    good = f"{key}={env[key]}"
    bad = bad_line(key, env[key])
    broken = _render(env).replace(f"{good}\n", f"{bad}\n")
    located = (f"In {path}, the line that sets `{key}` {what}. Rewrite it as plain KEY=value with "
               "the same value, run `check`, then finish.")
    return _draft(path, env, broken, bad, good, why, located, _format_symptom(path))


def spaced_equals(rng: random.Random) -> TaskDraft:
    """Spaces around ``=`` on one line."""
    return _line_defect(rng, lambda k, v: f"{k} = {v}", "no spaces around `=`",
                        "has spaces around `=`")


def lowercase_key(rng: random.Random) -> TaskDraft:
    """One variable name in lower case."""
    return _line_defect(rng, lambda k, v: f"{k.lower()}={v}", "the name in upper case",
                        "has its name in lower case")


def quoted_value(rng: random.Random) -> TaskDraft:
    """One value in double quotes."""
    return _line_defect(rng, lambda k, v: f'{k}="{v}"', "no quotes around the value",
                        "wraps its value in double quotes")


def export_prefix(rng: random.Random) -> TaskDraft:
    """One line starts with ``export``."""
    return _line_defect(rng, lambda k, v: f"export {k}={v}", "no `export`",
                        "starts with `export`")


def missing_var(rng: random.Random) -> TaskDraft:
    """A documented variable is not set."""
    path, env, key = _setup(rng)
    first = next(iter(env))
    broken = _render({k: v for k, v in env.items() if k != key})
    old = f"{first}={env[first]}"
    new = f"{old}\n{key}={env[key]}"
    located = (f"{path} does not set `{key}`. Add it with the value README.md documents, run "
               "`check`, then finish.")
    symptom = (f"`check` fails on {path}. Fix {path} so it passes, with the values README.md "
               "documents, then finish.")
    return _draft(path, env, broken, old, new, "add the missing variable", located, symptom)


def duplicate_var(rng: random.Random) -> TaskDraft:
    """A variable is set twice; README.md says which value is right."""
    path, env, key = _setup(rng)
    right = env[key]
    wrong = rng.choice([v for v in _VARS[key] if v != right])
    pair = [f"{key}={right}", f"{key}={wrong}"]
    rng.shuffle(pair)
    broken = _render(env).replace(f"{key}={right}\n", "\n".join(pair) + "\n")
    old, new = "\n".join(pair), f"{key}={right}"
    located = (f"In {path}, `{key}` is set twice. Keep only the value README.md documents, run "
               "`check`, then finish.")
    symptom = (f"`check` fails on {path}. Fix {path} so it passes, with the values README.md "
               "documents, then finish.")
    return _draft(path, env, broken, old, new, "keep the documented value", located, symptom)


FAMILY = TemplateFamily(
    family_id=FAMILY_ID,
    builders={"spaced-equals": spaced_equals, "lowercase-key": lowercase_key,
              "missing-var": missing_var, "duplicate-var": duplicate_var,
              "quoted-value": quoted_value, "export-prefix": export_prefix},
    heldout_templates=("spaced-equals", "lowercase-key", "missing-var", "duplicate-var",
                       "quoted-value", "export-prefix"),
    description="Fix one defect in a strict KEY=value env file (family-disjoint held-out).",
)
