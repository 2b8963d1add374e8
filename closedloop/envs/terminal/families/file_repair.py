"""``file-repair-v1``: a plain config, list or CSV file has one defect; fix it.

Templates (the last two are held out):

- ``ini-wrong-value``: ``app.ini`` differs from the settings listed in ``README.md`` (protected)
  in one value. Grader ``ini_equal``: parsed sections and keys equal the expected mapping.
- ``csv-missing-header``: ``data.csv`` lost its header row; ``README.md`` (protected) names the
  columns. Grader ``csv_equal``: parsed rows equal the expected rows.
- ``ini-missing-key``: ``app.ini`` lacks one of the settings ``README.md`` (protected) lists.
  Grader ``ini_equal``.
- ``ini-duplicate-key``: one key of ``app.ini`` is set twice in its section, once to the value
  ``README.md`` (protected) lists and once to another; strict INI parsers reject the file.
  Grader ``ini_equal`` (strict: duplicates do not parse).
- ``duplicate-line``: a list file (requirements, hosts, allowlist) has one line twice in a row;
  ``README.md`` (protected) describes it.
  Grader ``lines_equal``: the lines (trailing spaces and blank lines at the end ignored) equal
  the expected lines.
- ``csv-bad-delimiter``: one row of ``data.csv`` uses ``;`` instead of ``,``; ``README.md``
  (protected) names the columns. Grader ``csv_equal``.

The INI templates are all trained on: they share ``app.ini`` and ``README.md`` drawn from one
small value space, so a held-out INI template would be a near duplicate of a train task.

Every template is posed at the three hint levels of ``base``; every gold edit is one
``replace`` (``exact`` quotes it, newlines shown as ``\\n``).

The visible ``check.py`` checks structure only (the INI parses and has every key; no line is
repeated; every row has the header's number of fields), so a wrong value passes it.
"""

from __future__ import annotations

import random

from closedloop.contracts import Action
from closedloop.envs.terminal.families.base import TaskDraft, TemplateFamily, shown

FAMILY_ID = "file-repair-v1"
_SECTIONS: dict[str, dict[str, tuple[str, ...]]] = {
    "server": {"host": ("0.0.0.0", "127.0.0.1", "localhost"), "port": ("80", "8080", "8443"),
               "workers": ("2", "4", "8")},
    "database": {"engine": ("sqlite", "postgres"), "pool": ("5", "10", "20"),
                 "dbname": ("shop", "ledger", "notes")},
    "logging": {"level": ("info", "debug", "warning"), "file": ("app.log", "server.log"),
                "rotate": ("daily", "weekly")},
}
_PACKAGES = ("attrs", "click", "idna", "jinja2", "numpy", "pyyaml", "requests", "rich", "six",
             "tqdm", "urllib3", "wheel")
_HOSTS = ("api", "cache", "db", "files", "gateway", "mail", "queue", "search", "web", "worker")
_CSV: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "items": (("name", "qty", "price"), ("apple", "bolt", "cable", "drill", "eraser", "fuse")),
    "staff": (("name", "team", "age"), ("ana", "ben", "cora", "dan", "eve", "finn")),
    "cities": (("city", "country", "pop"), ("oslo", "lima", "kyiv", "doha", "rome", "bern")),
}
_TEAMS = ("ops", "web", "data", "infra")
_COUNTRIES = ("no", "pe", "ua", "qa", "it", "ch")

_INI_CHECK = '''import configparser
import sys

REQUIRED = {required!r}
parser = configparser.ConfigParser()
try:
    parser.read_string(open("app.ini").read())
except (OSError, configparser.Error) as exc:
    print(f"FAIL: app.ini does not parse: {{exc}}")
    sys.exit(1)
for section, keys in REQUIRED.items():
    for key in keys:
        if not parser.has_option(section, key):
            print(f"FAIL: missing {{section}}.{{key}}")
            sys.exit(1)
print("OK")
'''
_LINES_CHECK = '''import sys

lines = [x.strip() for x in open({path!r}).read().splitlines() if x.strip()]
dups = sorted({{x for x in lines if lines.count(x) > 1}})
if dups:
    print(f"FAIL: repeated lines: {{dups}}")
    sys.exit(1)
print(f"OK: {{len(lines)}} lines")
'''
_CSV_CHECK = '''import csv
import sys

rows = list(csv.reader(open("data.csv", newline="")))
if not rows:
    print("FAIL: data.csv is empty")
    sys.exit(1)
width = len(rows[0])
for n, row in enumerate(rows, 1):
    if len(row) != width:
        print(f"FAIL: line {{n}} has {{len(row)}} fields, expected {{width}}")
        sys.exit(1)
print(f"OK: {{len(rows)}} rows, header {{rows[0]}}")
'''


def _gold(path: str, edit: Action, first_read: str | None = None) -> tuple[Action, ...]:
    reads = (Action.tool("read_file", path=first_read),) if first_read else ()
    return (*reads, Action.tool("read_file", path=path), edit,
            Action.tool("run", command="check"), Action.finish())


def _exact(path: str, old: str, new: str, why: str) -> str:
    return (f"In {path} replace `{shown(old)}` with `{shown(new)}` ({why}), run `check`, then "
            "finish.")


def _render_ini(conf: dict[str, dict[str, str]]) -> str:
    return "\n".join(f"[{s}]\n" + "".join(f"{k} = {v}\n" for k, v in kv.items())
                     for s, kv in conf.items())


def _ini_setup(rng: random.Random) -> tuple[dict[str, dict[str, str]], str, str, str]:
    """(config, README text, section, key): two sections, one (section, key) drawn."""
    sections = rng.sample(sorted(_SECTIONS), 2)
    conf = {s: {k: rng.choice(vals) for k, vals in _SECTIONS[s].items()} for s in sections}
    section = rng.choice(sections)
    key = rng.choice(sorted(conf[section]))
    readme = "# Service settings\n\napp.ini must contain exactly these values:\n\n" + "".join(
        f"- {s}.{k} = {v}\n" for s, kv in conf.items() for k, v in kv.items())
    return conf, readme, section, key


def _ini_draft(conf: dict[str, dict[str, str]], readme: str, broken: str, edit: Action,
               hints: dict[str, str], symptom: str) -> TaskDraft:
    required = {s: sorted(kv) for s, kv in conf.items()}
    return TaskDraft(
        objective=symptom, hints=hints,
        initial_files={"app.ini": broken, "README.md": readme,
                       "check.py": _INI_CHECK.format(required=required)},
        commands={"check": ("python3", "check.py")},
        protected_paths=("README.md",), validator_paths=("check.py",),
        checks={"kind": "ini_equal", "path": "app.ini", "expected": conf},
        gold_actions=_gold("app.ini", edit, first_read="README.md"),
    )


def ini_missing_key(rng: random.Random) -> TaskDraft:
    """One setting README.md lists is absent from app.ini."""
    conf, readme, section, key = _ini_setup(rng)
    broken = {s: {k: v for k, v in kv.items() if (s, k) != (section, key)}
              for s, kv in conf.items()}
    old, new = f"[{section}]", f"[{section}]\n{key} = {conf[section][key]}"
    return _ini_draft(conf, readme, _render_ini(broken),
                      Action.tool("replace", path="app.ini", old=old, new=new),
                      {"exact": _exact("app.ini", old, new, "add the missing setting"),
                       "located": (f"app.ini lacks the setting `{key}` in section `[{section}]`. "
                                   "Add it with the value README.md lists, run `check`, then "
                                   "finish.")},
                      "`check` fails on app.ini. Make app.ini match the settings README.md "
                      "lists, changing nothing else, then finish.")


def ini_duplicate_key(rng: random.Random) -> TaskDraft:
    """A key is set twice in its section; README.md says which value is right."""
    conf, readme, section, key = _ini_setup(rng)
    right = conf[section][key]
    wrong = rng.choice([v for v in _SECTIONS[section][key] if v != right])
    pair = [f"{key} = {right}", f"{key} = {wrong}"]
    rng.shuffle(pair)
    text = _render_ini(conf).replace(f"{key} = {right}\n", "\n".join(pair) + "\n", 1)
    old, new = "\n".join(pair), f"{key} = {right}"
    return _ini_draft(conf, readme, text,
                      Action.tool("replace", path="app.ini", old=old, new=new),
                      {"exact": _exact("app.ini", old, new, "keep the value README.md lists"),
                       "located": (f"In app.ini, `{key}` is set twice in section `[{section}]`. "
                                   "Keep only the value README.md lists, run `check`, then "
                                   "finish.")},
                      "app.ini does not parse as a strict INI file. Fix it so it matches the "
                      "settings README.md lists, run `check`, then finish.")


def ini_wrong_value(rng: random.Random) -> TaskDraft:
    """One INI value differs from the README's list of required settings."""
    sections = rng.sample(sorted(_SECTIONS), 2)
    conf = {s: {k: rng.choice(vals) for k, vals in _SECTIONS[s].items()} for s in sections}
    section = rng.choice(sections)
    key = rng.choice(sorted(conf[section]))
    wrong = rng.choice([v for v in _SECTIONS[section][key] if v != conf[section][key]])
    broken = {s: {k: (wrong if (s, k) == (section, key) else v) for k, v in kv.items()}
              for s, kv in conf.items()}
    readme = "# Service settings\n\napp.ini must contain exactly these values:\n\n" + "".join(
        f"- {s}.{k} = {v}\n" for s, kv in conf.items() for k, v in kv.items())
    required = {s: sorted(kv) for s, kv in conf.items()}
    old, new = f"{key} = {wrong}", f"{key} = {conf[section][key]}"
    edit = Action.tool("replace", path="app.ini", old=old, new=new)
    return TaskDraft(
        objective=("app.ini does not match the settings README.md lists. Make it match, changing "
                   "nothing else, run `check`, then finish."),
        hints={"exact": _exact("app.ini", old, new, "the value README.md lists"),
               "located": (f"In app.ini, `{key}` in section `[{section}]` differs from the value "
                           "README.md lists. Set it to the listed value and change nothing else, "
                           "run `check`, then finish.")},
        initial_files={"app.ini": _render_ini(broken), "README.md": readme,
                       "check.py": _INI_CHECK.format(required=required)},
        commands={"check": ("python3", "check.py")},
        protected_paths=("README.md",), validator_paths=("check.py",),
        checks={"kind": "ini_equal", "path": "app.ini", "expected": conf},
        gold_actions=_gold("app.ini", edit, first_read="README.md"),
    )


def duplicate_line(rng: random.Random) -> TaskDraft:
    """A list file repeats one line directly after itself."""
    kind = rng.choice(("requirements", "hosts", "allowlist"))
    if kind == "requirements":
        path = "requirements.txt"
        lines = [f"{p}=={rng.randint(1, 9)}.{rng.randint(0, 20)}.{rng.randint(0, 9)}"
                 for p in sorted(rng.sample(_PACKAGES, 5))]
    elif kind == "hosts":
        path = "hosts.txt"
        lines = [f"10.0.{rng.randint(0, 9)}.{rng.randint(2, 250)} {h}.internal"
                 for h in rng.sample(_HOSTS, 5)]
    else:
        path = "allowlist.txt"
        lines = [f"{h}-{rng.randint(10, 99)}" for h in rng.sample(_HOSTS, 5)]
    k = rng.randrange(len(lines))
    broken = lines[:k + 1] + lines[k:]
    old, new = f"{lines[k]}\n{lines[k]}", lines[k]
    edit = Action.tool("replace", path=path, old=old, new=new)
    return TaskDraft(
        objective=(f"`check` fails on {path}. Fix {path} so it passes without reordering the "
                   "entries, then finish."),
        hints={"exact": _exact(path, old, new, "drop the repeated copy"),
               "located": (f"In {path}, line {k + 1} is repeated on line {k + 2}. Delete the "
                           "extra copy, keep the order of the other lines, run `check`, then "
                           "finish.")},
        initial_files={path: "\n".join(broken) + "\n",
                       "check.py": _LINES_CHECK.format(path=path),
                       "README.md": f"# {path}\n\nOne {kind} entry per line, each listed once.\n"},
        commands={"check": ("python3", "check.py")},
        protected_paths=("README.md",), validator_paths=("check.py",),
        checks={"kind": "lines_equal", "path": path, "expected": lines},
        gold_actions=_gold(path, edit),
    )


def _table(rng: random.Random) -> tuple[list[str], list[list[str]]]:
    header, keys = _CSV[rng.choice(sorted(_CSV))]
    rows: list[list[str]] = []
    for key in rng.sample(keys, 4):
        if header[1] == "qty":
            price = f"{rng.randint(1, 99)}.{rng.randint(0, 9)}0"
            rows.append([key, str(rng.randint(1, 50)), price])
        elif header[1] == "team":
            rows.append([key, rng.choice(_TEAMS), str(rng.randint(20, 60))])
        else:
            rows.append([key, rng.choice(_COUNTRIES), str(rng.randint(100, 999))])
    return list(header), rows


def _csv_text(rows: list[list[str]]) -> str:
    return "".join(",".join(r) + "\n" for r in rows)


def _csv_readme(header: list[str]) -> str:
    return f"# data.csv\n\nComma-separated. Columns, in order: {', '.join(header)}.\n"


def _csv_draft(objectives: tuple[str, str, str], broken: str, expected: list[list[str]],
               edit: Action, readme: str) -> TaskDraft:
    """objectives: (exact, located, symptom)."""
    files = {"data.csv": broken, "check.py": _CSV_CHECK.format(), "README.md": readme}
    exact, located, symptom = objectives
    return TaskDraft(
        objective=symptom, hints={"exact": exact, "located": located}, initial_files=files,
        commands={"check": ("python3", "check.py")},
        protected_paths=("README.md",),
        validator_paths=("check.py",),
        checks={"kind": "csv_equal", "path": "data.csv", "expected": expected},
        gold_actions=_gold("data.csv", edit),
    )


def csv_missing_header(rng: random.Random) -> TaskDraft:
    """The header row is missing; README.md names the columns."""
    header, rows = _table(rng)
    old = ",".join(rows[0])
    new = f"{','.join(header)}\n{old}"
    objectives = (
        _exact("data.csv", old, new, "insert the header row"),
        "data.csv lacks its header row. Insert the column names README.md lists as the first "
        "line, keep the data rows unchanged, run `check`, then finish.",
        "data.csv does not follow the format README.md describes. Fix it without changing any "
        "value, run `check`, then finish.")
    edit = Action.tool("replace", path="data.csv", old=old, new=new)
    return _csv_draft(objectives, _csv_text(rows), [header, *rows], edit, _csv_readme(header))


def csv_bad_delimiter(rng: random.Random) -> TaskDraft:
    """One data row is separated by semicolons."""
    header, rows = _table(rng)
    k = rng.randrange(len(rows))
    lines = [",".join(r) for r in (header, *rows)]
    bad = ";".join(rows[k])
    broken = "".join((bad if i == k + 1 else line) + "\n" for i, line in enumerate(lines))
    good = ",".join(rows[k])
    objectives = (
        _exact("data.csv", bad, good, "commas between the fields"),
        f"In data.csv, line {k + 2} (the `{rows[k][0]}` row) separates its fields with `;` "
        "instead of `,`. Fix that line without changing any value, run `check`, then finish.",
        "`check` fails on data.csv. Fix data.csv so it passes without changing any value, then "
        "finish.")
    edit = Action.tool("replace", path="data.csv", old=bad, new=good)
    return _csv_draft(objectives, broken, [header, *rows], edit, _csv_readme(header))


FAMILY = TemplateFamily(
    family_id=FAMILY_ID,
    builders={"ini-wrong-value": ini_wrong_value, "csv-missing-header": csv_missing_header,
              "ini-missing-key": ini_missing_key, "ini-duplicate-key": ini_duplicate_key,
              "duplicate-line": duplicate_line, "csv-bad-delimiter": csv_bad_delimiter},
    heldout_templates=("duplicate-line", "csv-bad-delimiter"),
    description="Fix one defect in a plain config, list or CSV file.",
)
