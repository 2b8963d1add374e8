"""The terminal sandbox runs the standard library: every pure-Python standard-library module
imports inside it, apart from those refused by design, each listed with its reason
(closedloop.envs.terminal.sandbox). Refusals stay where they matter: using a process, a socket
or ctypes (tests/envs/terminal/test_sandbox.py), not importing the module that offers it."""

from __future__ import annotations

import importlib.util
import json
import sys

from closedloop.envs.terminal import run_command
from closedloop.envs.terminal.sandbox import SandboxConfig

REFUSED_BY_DESIGN = {
    "ctypes": "foreign memory and calls past the audit hook: the import of _ctypes is refused",
}
"""Modules whose import the sandbox refuses, with the reason."""

NOT_PROBED = {
    "antigravity": "opens a web browser on import",
    "this": "prints the Zen of Python on import",
    "idlelib": "the IDLE editor (a GUI application, not a library)",
    "test": "CPython's own regression tests",
    "turtledemo": "demo scripts of the turtle GUI",
}
"""Standard-library modules left out of the probe: importing them does something else."""


def pure_python_stdlib() -> list[str]:
    """Public top-level standard-library modules implemented in Python (``.py`` sources)."""
    names = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in NOT_PROBED:
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            names.append(name)
    return names


PROBE = """import importlib, json
failed = {}
for name in NAMES:
    try:
        importlib.import_module(name)
    except BaseException as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"[:300]
print(json.dumps(failed))
"""


def test_every_pure_python_stdlib_module_imports_in_the_sandbox() -> None:
    names = pure_python_stdlib()
    assert len(names) > 120 and {"dataclasses", "logging", "unittest", "pprint", "tomllib",
                                 "collections", "json", "csv", "argparse"} <= set(names)
    r = run_command(("python3", "probe.py"), {"probe.py": PROBE.replace("NAMES", repr(names))},
                    config=SandboxConfig(timeout_s=60.0, output_cap_bytes=65536))
    assert r.exit_code == 0 and not r.truncated, r.stderr
    failed = json.loads(r.stdout)
    assert set(failed) == set(REFUSED_BY_DESIGN), failed
    assert all("sandbox: import refused" in why for why in failed.values()), failed


def test_what_the_standard_library_sets_on_its_functions_works() -> None:
    src = ("import collections, dataclasses, functools, logging, pprint, tomllib, unittest\n"
           "P = collections.namedtuple('P', 'x y', defaults=(0,))\n"
           "@dataclasses.dataclass(frozen=True)\nclass D:\n    a: int = 1\n"
           "logging.basicConfig(level=logging.INFO)\nlogging.getLogger('t').info('logged')\n"
           "pprint.pprint({'p': P(1), 'd': D(), 't': tomllib.loads('k = 2')})\n")
    r = run_command(("python3", "prog.py"), {"prog.py": src},
                    config=SandboxConfig(timeout_s=10.0))
    assert r.exit_code == 0, r.stderr
    assert "P(x=1, y=0)" in r.stdout and "D(a=1)" in r.stdout and "'k': 2" in r.stdout
    assert "INFO:t:logged" in r.stderr
