"""The package's layers, checked on the sources (ast): no module imports from a layer above its
own, at module level, inside a function or under ``if TYPE_CHECKING:`` — no exemption.

Layers, bottom to top (a module may import its own layer and the ones below):

0. ``closedloop.errors``, ``closedloop.intervals``, ``closedloop.progress``,
``closedloop.contracts``
1. ``closedloop.envs`` (the framework and one package per environment)
2. ``closedloop.policy``, ``closedloop.engine`` (the engine's own boundary: ``test_boundary.py``)
3. ``closedloop.rollout``
4. ``closedloop.learn``
5. ``closedloop.evaluate``, ``closedloop.export``
6. ``closedloop.config``
7. ``closedloop.training`` (one run: wiring, roles, loop, integrity)
8. ``closedloop.experiments`` (controls, replicates, reevaluation)
9. ``closedloop.cli``, ``closedloop`` itself

Every module of the package must fall in one layer, so a new top-level module or subpackage
has to be placed in the table before it can land. Within ``closedloop.envs`` the generic part
never imports an environment's own package (``test_no_generic_module_imports_an_environment``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS: dict[str, int] = {
    "closedloop.errors": 0, "closedloop.intervals": 0, "closedloop.progress": 0,
    "closedloop.contracts": 0,
    "closedloop.envs": 1,
    "closedloop.policy": 2, "closedloop.engine": 2,
    "closedloop.rollout": 3,
    "closedloop.learn": 4,
    "closedloop.evaluate": 5, "closedloop.export": 5,
    "closedloop.config": 6,
    "closedloop.training": 7,
    "closedloop.experiments": 8,
    "closedloop.cli": 9, "closedloop": 9,
}
ENVIRONMENT_PACKAGES = ("terminal", "keydoor", "shopping", "searchqa")
"""``closedloop.envs`` subpackages that are environments (the rest is the framework)."""


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
    """``closedloop/envs/plugin.py`` -> ``closedloop.envs.discovery`` (a package: its name)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


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
    """Each import in ``source`` (the module ``module``) that reaches a layer above its own."""
    own = layer_of(module)
    if own is None:
        return [f"{module}: not placed in LAYERS"]
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        for target in imported_modules(node, module, is_package):
            if not target.startswith("closedloop"):
                continue
            theirs = layer_of(target)
            if theirs is None:
                found.append(f"{module}:{node.lineno} imports {target}, not placed in LAYERS")
            elif theirs > own:
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


def environment_of(module: str) -> str | None:
    """The environment package ``module`` belongs to (``closedloop.envs.<env>``), else None."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[:2] == ["closedloop", "envs"] and (
            parts[2] in ENVIRONMENT_PACKAGES):
        return parts[2]
    return None


def test_no_generic_module_imports_an_environment():
    found = []
    for p in package_sources():
        module = module_name(p)
        own = environment_of(module)
        tree = ast.parse(p.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            for target in imported_modules(node, module, p.name == "__init__.py"):
                theirs = environment_of(target)
                if theirs is not None and theirs != own:
                    found.append(f"{module}:{node.lineno} imports {target}")
    assert found == []


def test_every_subpackage_and_top_level_module_is_placed():
    names = {module_name(p) for p in package_sources()}
    unplaced = sorted(n for n in names if layer_of(n) is None)
    assert unplaced == []
    # each entry of the table names something that exists
    assert {k for k in LAYERS if k != "closedloop"} <= {".".join(n.split(".")[:2]) for n in names}


@pytest.mark.parametrize(("line", "module"), [
    ("def f():\n    from closedloop.learn.trainer import Trainer", "closedloop.envs.x"),
    ("from closedloop.rollout import Collector", "closedloop.envs.terminal.families.x"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from closedloop.learn import T",
     "closedloop.envs.x"),
    ("import closedloop.evaluate.stats", "closedloop.rollout.x"),
    ("from closedloop.evaluate.stats import wilson_interval", "closedloop.envs.verifier_audit"),
    ("from closedloop import training", "closedloop.learn.x"),
    ("from closedloop.config import RunConfig", "closedloop.evaluate.x"),
    ("from closedloop.envs import EnvError", "closedloop.errors"),
    ("from closedloop.rollout import Ledger", "closedloop.policy.x"),
    ("from ..learn import trainer", "closedloop.rollout.x"),
    ("import closedloop.newpackage", "closedloop.learn.x"),
    ("if TYPE_CHECKING:\n    from closedloop.learn.kl import KLSpec", "closedloop.contracts.x"),
    ("if TYPE_CHECKING:\n    from closedloop.rollout.tensors import T",
     "closedloop.contracts.update"),
    ("from closedloop.experiments.controls import ARMS", "closedloop.training.loop"),
])
def test_an_upward_import_is_caught(line, module):
    assert violations(line, module)


@pytest.mark.parametrize(("line", "module"), [
    ("from closedloop.errors import EnvError", "closedloop.envs.x"),
    ("from closedloop.contracts import Action", "closedloop.envs.terminal.x"),
    ("from closedloop.policy.generator import Generator", "closedloop.engine.x"),
    ("from closedloop.envs.terminal.verifier import check_solvable", "closedloop.training"),
    ("from closedloop import errors", "closedloop.rollout.x"),
    ("from . import base", "closedloop.envs.terminal.families.x"),
    ("import torch", "closedloop.contracts.x"),
    ("from closedloop.training.loop import train", "closedloop.experiments.controls"),
])
def test_a_downward_or_same_layer_import_is_allowed(line, module):
    assert violations(line, module) == []


def test_a_module_outside_the_table_is_reported():
    assert violations("import os", "closedloop.newpackage.x")


def test_an_environment_reached_from_the_framework_is_caught():
    assert environment_of("closedloop.envs.terminal.verifier") == "terminal"
    assert environment_of("closedloop.envs.discovery") is None
    assert environment_of("closedloop.evaluate.retain") is None
