"""The package's layers, checked on the sources (ast): no module imports from a layer above its
own, at module level or inside a function. An import under ``if TYPE_CHECKING:`` (annotations
only, never executed) may reach up only where ``ANNOTATION_ONLY`` names it.

Layers, bottom to top (a module may import its own layer and the ones below):

0. ``closedloop.errors``, ``closedloop.intervals``, ``closedloop.contracts``
1. ``closedloop.envs``
2. ``closedloop.verify``
3. ``closedloop.policy``, ``closedloop.engine`` (the engine's own boundary: ``test_boundary.py``)
4. ``closedloop.rollout``
5. ``closedloop.learn``
6. ``closedloop.evaluate``
7. the run modules: ``closedloop`` itself, ``config``, ``runtime``, ``run_integrity``,
   ``training``, ``loop``, ``experiment``, ``replicates``, ``export``, ``progress``, ``cli``

Every module of the package must fall in one layer, so a new top-level module or subpackage
has to be placed in the table before it can land.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS: dict[str, int] = {
    "closedloop.errors": 0, "closedloop.intervals": 0, "closedloop.contracts": 0,
    "closedloop.envs": 1,
    "closedloop.verify": 2,
    "closedloop.policy": 3, "closedloop.engine": 3,
    "closedloop.rollout": 4,
    "closedloop.learn": 5,
    "closedloop.evaluate": 6,
    **{f"closedloop.{m}": 7 for m in ("config", "runtime", "run_integrity", "training", "loop",
                                      "experiment", "replicates", "reevaluate", "export",
                                      "progress", "cli")},
    "closedloop": 7,
}


def layer_of(module: str) -> int | None:
    """The layer of ``module`` (its longest prefix in ``LAYERS``); None outside closedloop or
    for a closedloop module the table does not place."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in LAYERS and (n > 1 or len(parts) == 1):
            return LAYERS[prefix]
    return None


def module_name(path: Path) -> str:
    """``closedloop/envs/plugin.py`` -> ``closedloop.envs.plugin`` (a package: its name)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


ANNOTATION_ONLY = frozenset({
    # the update contract annotates with the learn layer's KL spec and rollout's batch
    "closedloop.contracts.update imports closedloop.learn.kl",
    "closedloop.contracts.update imports closedloop.rollout.tensors",
})
"""Upward imports allowed under ``TYPE_CHECKING``: ``<module> imports <target>``."""


def type_checking_lines(tree: ast.AST) -> set[int]:
    """Line numbers inside ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``) bodies."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING",
                                                                  "typing.TYPE_CHECKING"):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imported_modules(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The closedloop modules an import node names (``from closedloop import x`` names
    ``closedloop.x``; relative imports are resolved against ``module``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        anchor = package[:len(package) - (node.level - 1)]
        base = ".".join([*anchor, *([base] if base else [])])
    if base == "closedloop":
        return [f"closedloop.{a.name}" for a in node.names]
    return [base]


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Each import in ``source`` (the module ``module``) that reaches a layer above its own,
    except the ``TYPE_CHECKING`` imports ``ANNOTATION_ONLY`` allows."""
    own = layer_of(module)
    if own is None:
        return [f"{module}: not placed in LAYERS"]
    tree = ast.parse(source)
    annotations_only = type_checking_lines(tree)
    found = []
    for node in ast.walk(tree):
        for target in imported_modules(node, module, is_package):
            if not target.startswith("closedloop"):
                continue
            theirs = layer_of(target)
            if theirs is None:
                found.append(f"{module}:{node.lineno} imports {target}, not placed in LAYERS")
            elif theirs > own and not (node.lineno in annotations_only
                                       and f"{module} imports {target}" in ANNOTATION_ONLY):
                found.append(f"{module}:{node.lineno} (layer {own}) imports {target} "
                             f"(layer {theirs})")
    return found


def package_sources() -> list[Path]:
    """Every Python source of the package."""
    return sorted((ROOT / "closedloop").rglob("*.py"))


def test_no_module_imports_from_a_higher_layer():
    sources = package_sources()
    assert len(sources) > 100  # the walk found the tree
    found = [v for p in sources
             for v in violations(p.read_text(encoding="utf-8"), module_name(p),
                                 p.name == "__init__.py")]
    assert found == []


def test_every_annotation_only_exception_is_still_needed():
    used = set()
    for p in package_sources():
        tree = ast.parse(p.read_text(encoding="utf-8"))
        lines = type_checking_lines(tree)
        used |= {f"{module_name(p)} imports {t}" for n in ast.walk(tree)
                 if getattr(n, "lineno", 0) in lines
                 for t in imported_modules(n, module_name(p), p.name == "__init__.py")}
    assert used >= ANNOTATION_ONLY


def test_every_subpackage_and_top_level_module_is_placed():
    names = {module_name(p) for p in package_sources()}
    unplaced = sorted(n for n in names if layer_of(n) is None)
    assert unplaced == []
    # each entry of the table names something that exists
    assert {k for k in LAYERS if k != "closedloop"} <= {".".join(n.split(".")[:2]) for n in names}


@pytest.mark.parametrize(("line", "module"), [
    ("def f():\n    from closedloop.verify.verifier import check_solvable", "closedloop.envs.x"),
    ("from closedloop.verify import Verifier", "closedloop.envs.tasks.x"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from closedloop.verify import V",
     "closedloop.envs.x"),
    ("import closedloop.evaluate.stats", "closedloop.rollout.x"),
    ("from closedloop.evaluate.stats import wilson_interval", "closedloop.verify.audit"),
    ("from closedloop import training", "closedloop.learn.x"),
    ("from closedloop.config import RunConfig", "closedloop.evaluate.x"),
    ("from closedloop.envs import EnvError", "closedloop.errors"),
    ("from closedloop.rollout import Ledger", "closedloop.policy.x"),
    ("from ..learn import trainer", "closedloop.rollout.x"),
    ("import closedloop.newpackage", "closedloop.learn.x"),
    ("if TYPE_CHECKING:\n    from closedloop.learn.kl import KLSpec", "closedloop.contracts.x"),
    ("if TYPE_CHECKING:\n    from closedloop.learn import T", "closedloop.contracts.update"),
])
def test_an_upward_import_is_caught(line, module):
    assert violations(line, module)


@pytest.mark.parametrize(("line", "module"), [
    ("from closedloop.errors import EnvError", "closedloop.envs.x"),
    ("from closedloop.contracts import Action", "closedloop.verify.x"),
    ("from closedloop.policy.generator import Generator", "closedloop.engine.x"),
    ("from closedloop.verify.verifier import check_solvable", "closedloop.training"),
    ("from closedloop import errors", "closedloop.rollout.x"),
    ("from . import base", "closedloop.envs.tasks.x"),
    ("import torch", "closedloop.contracts.x"),
    ("if TYPE_CHECKING:\n    from closedloop.learn.kl import X", "closedloop.contracts.update"),
])
def test_a_downward_or_same_layer_import_is_allowed(line, module):
    assert violations(line, module) == []


def test_a_module_outside_the_table_is_reported():
    assert violations("import os", "closedloop.newpackage.x")
