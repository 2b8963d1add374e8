"""``cli-repair-v1``: a tiny stdlib Python CLI (``prog.py``) prints the wrong answer; fix the bug.

The workspace holds ``prog.py``, its input ``input.txt`` (protected) and ``check.py``, which runs
``prog.py`` on ``input.txt`` in-process and compares with the expected output for that one input.
The ``prog`` command runs the program; ``check`` runs the validator.

Templates (the last two are held out):

- ``off-by-one``: a sum loop stops one element early (``range(len(xs) - 1)``).
- ``wrong-builtin``: ``min`` where ``max`` is meant, or the reverse.
- ``wrong-separator``: CSV lines are split on ``;`` instead of ``,``.
- ``wrong-comparison``: a count of the integers above a threshold compares with ``<``.
- ``sort-order``: words are sorted in the wrong direction.
- ``wrong-index``: the names of a CSV's first column are read from the second column.

Every template is posed at the three hint levels of ``base``: ``exact`` quotes the one-line
gold ``replace``, ``located`` names the function and what is wrong in it, ``symptom`` says what
the program should print.

Hidden grader (``kind="program_output"``): runs the final ``prog.py`` in a fresh directory on the
visible input and on two hidden inputs and compares stdout with the reference outputs computed by
the generator. A fix that special-cases the visible input passes ``check`` but fails the grader.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from closedloop.contracts import Action
from closedloop.envs.terminal.families.base import TaskDraft, TemplateFamily, shown
from closedloop.errors import TaskGenerationError

FAMILY_ID = "cli-repair-v1"
_VARS = ("xs", "values", "nums", "items", "data")
_WORDS = ("amber", "birch", "cedar", "dune", "elm", "fern", "grove", "heath", "iris", "juniper",
          "kelp", "larch", "moss", "nettle", "oak", "pine")

_CHECK = '''import contextlib
import io
import runpy
import sys

EXPECTED = {expected!r}
out = io.StringIO()
sys.argv = ["prog.py", "input.txt"]
try:
    with contextlib.redirect_stdout(out):
        runpy.run_path("prog.py", run_name="__main__")
except Exception as exc:
    print(f"FAIL: prog.py raised {{type(exc).__name__}}: {{exc}}")
    sys.exit(1)
got = out.getvalue().strip()
if got != EXPECTED:
    print(f"FAIL: expected {{EXPECTED!r}}, got {{got!r}}")
    sys.exit(1)
print("OK")
'''

_SUM = '''import sys


def {fn}(path):
    with open(path) as f:
        {v} = [int(line) for line in f if line.strip()]
    total = 0
    for i in range(len({v}){bug}):
        total += {v}[i]
    return total


print({fn}(sys.argv[1]))
'''
_EXTREME = '''import sys


def {fn}(path):
    {v} = [int(tok) for tok in open(path).read().split()]
    return {builtin}({v})


print({fn}(sys.argv[1]))
'''
_CSV_TOTAL = '''import sys


def {fn}(path):
    total = 0
    for line in open(path).read().splitlines()[1:]:
        name, qty = line.split("{sep}")
        total += int(qty)
    return total


print({fn}(sys.argv[1]))
'''
_COUNT_ABOVE = '''import sys


def {fn}(path):
    {v} = [int(tok) for tok in open(path).read().split()]
    return len([n for n in {v} if n {op} {limit}])


print({fn}(sys.argv[1]))
'''
_COLUMN = '''import sys


def {fn}(path):
    names = []
    for line in open(path).read().splitlines()[1:]:
        fields = line.split(",")
        names.append(fields[{col}])
    return names


for name in {fn}(sys.argv[1]):
    print(name)
'''
_SORT = '''import sys


def {fn}(path):
    words = open(path).read().split()
    return sorted(words{rev})


for word in {fn}(sys.argv[1]):
    print(word)
'''


def _ints(rng: random.Random) -> list[int]:
    """4-7 distinct non-zero integers (so a dropped element or a swapped builtin shows)."""
    pool = [n for n in range(-20, 91) if n != 0]
    return rng.sample(pool, rng.randint(4, 7))


def _inputs(rng: random.Random, make: Callable[[random.Random], str],
            reference: Callable[[str], str]) -> list[str]:
    """Draw 3 inputs whose reference outputs are pairwise different (visible + 2 hidden)."""
    inputs: list[str] = []
    seen: set[str] = set()
    for _ in range(100):
        text = make(rng)
        if reference(text) not in seen:
            inputs.append(text)
            seen.add(reference(text))
            if len(inputs) == 3:
                return inputs
    raise TaskGenerationError("could not draw 3 inputs with different outputs")


def _draft(purpose: str, source: str, fixed: str, edit: tuple[str, str],
           inputs: list[str], reference: Callable[[str], str], located: str) -> TaskDraft:
    """Assemble a CLI draft; ``inputs[0]`` is visible, the rest are hidden grader inputs.

    located: what is wrong where in prog.py (one clause, e.g. "the loop in `f` stops early").
    """
    fixed_source = source.replace(*edit)
    if fixed_source != fixed or source.count(edit[0]) != 1:
        raise TaskGenerationError("the gold edit does not turn the buggy source into the fixed one")
    cases = [{"input": text, "expected": reference(text)} for text in inputs]
    objective = (f"prog.py should {purpose}, but its output is wrong. Fix it with a small edit, "
                 "run `prog` to see its output and `check` to test it, then finish.")
    return TaskDraft(
        objective=objective,
        hints={"exact": (f"In prog.py replace `{shown(edit[0])}` with `{shown(edit[1])}`, run "
                         "`check`, then finish."),
               "located": f"In prog.py, {located}. Fix that line, run `check`, then finish."},
        initial_files={"prog.py": source, "input.txt": inputs[0],
                       "check.py": _CHECK.format(expected=cases[0]["expected"])},
        commands={"prog": ("python3", "prog.py", "input.txt"),
                  "check": ("python3", "check.py")},
        protected_paths=("input.txt",), validator_paths=("check.py",),
        checks={"kind": "program_output", "path": "prog.py", "input_name": "input.txt",
                "cases": cases, "timeout_s": 5.0},
        gold_actions=(Action.tool("read_file", path="prog.py"), Action.tool("run", command="prog"),
                      Action.tool("replace", path="prog.py", old=edit[0], new=edit[1]),
                      Action.tool("run", command="check"), Action.finish()),
    )


def off_by_one(rng: random.Random) -> TaskDraft:
    """The sum loop skips the last number."""
    fn, v = rng.choice(("add_up", "sum_lines", "sum_file")), rng.choice(_VARS)
    source = _SUM.format(fn=fn, v=v, bug=" - 1")
    fixed = _SUM.format(fn=fn, v=v, bug="")
    def ref(t: str) -> str:
        return str(sum(int(x) for x in t.split()))

    inputs = _inputs(rng, lambda r: "".join(f"{n}\n" for n in _ints(r)), ref)
    return _draft("print the sum of the integers in input.txt (one per line)", source, fixed,
                  (f"range(len({v}) - 1)", f"range(len({v}))"), inputs, ref,
                  f"the loop in `{fn}` stops one element before the end of `{v}`")


def wrong_builtin(rng: random.Random) -> TaskDraft:
    """``min`` and ``max`` are swapped."""
    want, bug = rng.choice((("max", "min"), ("min", "max")))
    fn, v = rng.choice(("pick", "extreme", "answer")), rng.choice(_VARS)
    source = _EXTREME.format(fn=fn, v=v, builtin=bug)
    fixed = _EXTREME.format(fn=fn, v=v, builtin=want)
    word = "largest" if want == "max" else "smallest"
    pick = max if want == "max" else min

    def ref(t: str) -> str:
        return str(pick(int(x) for x in t.split()))

    inputs = _inputs(rng, lambda r: " ".join(str(n) for n in _ints(r)) + "\n", ref)
    other = "smallest" if want == "max" else "largest"
    return _draft(f"print the {word} integer in input.txt", source, fixed,
                  (f"{bug}({v})", f"{want}({v})"), inputs, ref,
                  f"`{fn}` returns the {other} value instead of the {word}: it calls the wrong "
                  "builtin")


def wrong_separator(rng: random.Random) -> TaskDraft:
    """CSV lines are split on the wrong character."""
    fn = rng.choice(("total_qty", "count_units", "stock"))
    source = _CSV_TOTAL.format(fn=fn, sep=";")
    fixed = _CSV_TOTAL.format(fn=fn, sep=",")

    def ref(t: str) -> str:
        return str(sum(int(r.split(",")[1]) for r in t.splitlines()[1:]))

    def make(r: random.Random) -> str:
        rows = [f"{w},{r.randint(0, 40)}\n" for w in r.sample(_WORDS, r.randint(3, 5))]
        return "name,qty\n" + "".join(rows)

    return _draft("print the total of the qty column of input.txt (a CSV file with a header)",
                  source, fixed, ('split(";")', 'split(",")'), _inputs(rng, make, ref), ref,
                  f"`{fn}` splits each line on the wrong character (the fields are separated by "
                  "commas)")


def sort_order(rng: random.Random) -> TaskDraft:
    """Words are printed in the wrong order."""
    descending = rng.random() < 0.5
    fn = rng.choice(("ordered", "sort_words", "arrange"))
    good_rev, bad_rev = (", reverse=True", "") if descending else ("", ", reverse=True")
    source = _SORT.format(fn=fn, rev=bad_rev)
    fixed = _SORT.format(fn=fn, rev=good_rev)
    order = "reverse alphabetical" if descending else "alphabetical"
    edit = (f"sorted(words{bad_rev})", f"sorted(words{good_rev})")

    def ref(t: str) -> str:
        return "\n".join(sorted(t.split(), reverse=descending))

    inputs = _inputs(rng, lambda r: " ".join(r.sample(_WORDS, r.randint(4, 6))) + "\n", ref)
    return _draft(f"print the words of input.txt in {order} order, one per line", source, fixed,
                  edit, inputs, ref, f"`{fn}` sorts the words in the wrong direction")


def wrong_comparison(rng: random.Random) -> TaskDraft:
    """The count of integers above a limit uses ``<`` instead of ``>``."""
    fn, v = rng.choice(("count_above", "how_many", "tally")), rng.choice(_VARS)
    limit = rng.choice((0, 10, 25, 40))
    source = _COUNT_ABOVE.format(fn=fn, v=v, op="<", limit=limit)
    fixed = _COUNT_ABOVE.format(fn=fn, v=v, op=">", limit=limit)

    def ref(t: str) -> str:
        return str(sum(1 for x in t.split() if int(x) > limit))

    inputs = _inputs(rng, lambda r: " ".join(str(n) for n in _ints(r)) + "\n", ref)
    return _draft(f"print how many integers in input.txt are greater than {limit}", source,
                  fixed, (f"n < {limit}", f"n > {limit}"), inputs, ref,
                  f"`{fn}` counts the integers below {limit}, not above: its comparison points "
                  "the wrong way")


def wrong_index(rng: random.Random) -> TaskDraft:
    """The names are read from the second CSV column instead of the first."""
    fn = rng.choice(("read_names", "first_column", "labels"))
    source = _COLUMN.format(fn=fn, col=1)
    fixed = _COLUMN.format(fn=fn, col=0)

    def ref(t: str) -> str:
        return "\n".join(r.split(",")[0] for r in t.splitlines()[1:])

    def make(r: random.Random) -> str:
        rows = [f"{w},{r.randint(0, 40)}\n" for w in r.sample(_WORDS, r.randint(3, 5))]
        return "name,qty\n" + "".join(rows)

    return _draft("print the name column of input.txt (a CSV file with a header), one name per "
                  "line", source, fixed, ("fields[1]", "fields[0]"), _inputs(rng, make, ref), ref,
                  f"`{fn}` reads each name from the wrong field of the row (the name is the "
                  "first column)")


FAMILY = TemplateFamily(
    family_id=FAMILY_ID,
    builders={"off-by-one": off_by_one, "wrong-builtin": wrong_builtin,
              "wrong-separator": wrong_separator, "wrong-comparison": wrong_comparison,
              "sort-order": sort_order, "wrong-index": wrong_index},
    heldout_templates=("sort-order", "wrong-index"),
    description="Fix a one-line bug in a tiny Python command-line program.",
)
