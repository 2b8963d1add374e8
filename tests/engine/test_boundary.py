"""The engine's boundary, checked on the sources (ast): code outside ``closedloop/engine/``
imports only the package ``closedloop.engine``, never one of its submodules; the layers below it
(contracts, envs, verify, policy) do not import it at all; and the private internals the speed
work relies on (``torch.ops.mkldnn``, transformers' ``DynamicLayer``, rebinding a module's
``forward``) appear only inside engine submodules.

The engine's own tests (``tests/engine/``) test its submodules directly and are exempt.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import closedloop.engine

ROOT = Path(__file__).resolve().parents[2]
ENGINE = "closedloop.engine"
BELOW = ("closedloop/contracts/", "closedloop/envs/", "closedloop/verify/", "closedloop/policy/")
SUBMODULES = frozenset(p.stem for p in (ROOT / "closedloop" / "engine").glob("*.py")
                       if p.stem != "__init__")
PRIVATE_NAMES = frozenset({"DynamicLayer", "mkldnn"})


def outside_sources() -> list[Path]:
    """Every Python source outside the engine and its own tests."""
    files = [p for d in ("closedloop", "benchmarks", "tests") for p in (ROOT / d).rglob("*.py")]
    inside = (ROOT / "closedloop" / "engine", ROOT / "tests" / "engine")
    return sorted(p for p in files if not any(p.is_relative_to(d) for d in inside))


def violations(source: str, rel: str) -> list[str]:
    """What ``source`` (the file ``rel``, relative to the repository) breaks of the boundary."""
    found = []
    below = rel.startswith(BELOW)
    for node in ast.walk(ast.parse(source)):
        where = f"{rel}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(ENGINE + "."):
                    found.append(f"{where} imports the submodule {alias.name}")
                elif alias.name == ENGINE and below:
                    found.append(f"{where}: a layer below the engine imports it")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith(ENGINE + "."):
                found.append(f"{where} imports from the submodule {node.module}")
            elif node.module == ENGINE:
                if below:
                    found.append(f"{where}: a layer below the engine imports it")
                subs = [a.name for a in node.names if a.name in SUBMODULES]
                found += [f"{where} imports the submodule {ENGINE}.{s}" for s in subs]
        elif isinstance(node, ast.Attribute | ast.Name):
            name = node.attr if isinstance(node, ast.Attribute) else node.id
            if name in PRIVATE_NAMES:
                found.append(f"{where} uses the private internal {name}")
        elif isinstance(node, ast.Assign):
            if any(isinstance(t, ast.Attribute) and t.attr == "forward" for t in node.targets):
                found.append(f"{where} rebinds a forward")
        elif isinstance(node, ast.alias) and node.name in PRIVATE_NAMES:
            found.append(f"{where} imports the private internal {node.name}")
    return found


def test_code_outside_the_engine_imports_only_its_interface():
    sources = outside_sources()
    assert len(sources) > 100  # the walk found the tree
    found = [v for p in sources
             for v in violations(p.read_text(encoding="utf-8"), str(p.relative_to(ROOT)))]
    assert found == []


@pytest.mark.parametrize("line", [
    "from closedloop.engine.kv_cache import batch_cache",
    "import closedloop.engine.precision",
    "import closedloop.engine.precision as precision",
    "from closedloop.engine import llama_decode",
    "def f():\n    from closedloop.engine.hf_generator import HFGenerator",
    "import torch\ntorch.ops.mkldnn._linear_pointwise",
    "from transformers.cache_utils import DynamicLayer",
    "def patch(m, f):\n    m.forward = f",
])
def test_a_module_that_crosses_the_boundary_is_caught(line):
    assert violations(line, "closedloop/learn/example.py")


def test_layers_below_the_engine_may_not_import_it_at_all():
    line = "from closedloop.engine import HFGenerator"
    assert violations(line, "closedloop/policy/example.py")
    assert violations(line, "closedloop/learn/example.py") == []


def test_the_interface_is_the_package_all():
    assert sorted(closedloop.engine.__all__) == sorted(set(closedloop.engine.__all__))
    assert not SUBMODULES & set(closedloop.engine.__all__)
    for name in closedloop.engine.__all__:
        assert hasattr(closedloop.engine, name), name
