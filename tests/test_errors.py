"""The error hierarchy: every closedloop error class is defined in ``closedloop/errors.py``, under
``ClosedloopError``, with a docstring; no other module of the package defines an exception
class (checked on the sources, nested classes included, and on the imported modules); and
``closedloop.errors`` imports nothing from closedloop.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import closedloop
import closedloop.errors

ROOT = Path(__file__).resolve().parents[1]
ERRORS_PY = ROOT / "closedloop" / "errors.py"


def error_classes() -> list[type]:
    """The classes ``closedloop.errors`` defines."""
    return [c for _, c in inspect.getmembers(closedloop.errors, inspect.isclass)
            if c.__module__ == "closedloop.errors"]


def exception_names() -> frozenset[str]:
    """Names a base class can take that make a class an exception: the builtin exceptions and
    the classes of ``closedloop.errors``."""
    names = {n for n, v in vars(builtins).items()
             if isinstance(v, type) and issubclass(v, BaseException)}
    return frozenset(names | {c.__name__ for c in error_classes()})


def exception_classes_in(source: str) -> list[str]:
    """``name:line`` of every class in ``source`` (at any depth) with an exception base."""
    known = exception_names()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute)
                     else "" for b in node.bases]
            if any(b in known for b in bases):
                found.append(f"{node.name}:{node.lineno}")
    return found


def test_every_error_class_derives_from_the_root_and_says_when_it_is_raised():
    classes = error_classes()
    assert len(classes) > 90  # the hierarchy was found
    root = closedloop.errors.ClosedloopError
    assert [c.__name__ for c in classes if not issubclass(c, root)] == []
    assert [c.__name__ for c in classes if not (vars(c).get("__doc__") or "").strip()] == []


def test_no_other_module_defines_an_exception_class_in_its_source():
    sources = [p for p in sorted((ROOT / "closedloop").rglob("*.py")) if p != ERRORS_PY]
    assert len(sources) > 100
    found = [f"{p.relative_to(ROOT)}:{c}" for p in sources
             for c in exception_classes_in(p.read_text(encoding="utf-8"))]
    assert found == []


def test_no_imported_module_holds_an_exception_class_of_its_own():
    found = []
    for info in pkgutil.walk_packages(closedloop.__path__, "closedloop."):
        module = importlib.import_module(info.name)
        found += [f"{info.name}.{n}" for n, c in inspect.getmembers(module, inspect.isclass)
                  if issubclass(c, BaseException) and c.__module__ == info.name
                  and info.name != "closedloop.errors"]
    assert found == []


@pytest.mark.parametrize("source", [
    "class Oops(ValueError):\n    pass",
    "class Oops(Exception):\n    pass",
    "from closedloop.errors import LearnError\nclass Oops(LearnError):\n    pass",
    "import closedloop.errors as e\nclass Oops(e.ContractError):\n    pass",
    "def f():\n    class Oops(RuntimeError):\n        pass",
])
def test_an_exception_class_outside_errors_is_caught(source):
    assert exception_classes_in(source)


def test_a_plain_class_is_not_an_exception_class():
    assert exception_classes_in("class Record:\n    pass\nclass P(Protocol):\n    x: int") == []


def test_the_errors_module_imports_nothing_from_closedloop():
    tree = ast.parse(ERRORS_PY.read_text(encoding="utf-8"))
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "." for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom) and (n.level or n.module)]
    assert [m for m in imported if m.startswith(("closedloop", "."))] == []
