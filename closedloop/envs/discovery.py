"""Discovery of environment packages (``closedloop.contracts.package.EnvPackage``): by id, by a
dotted factory path, or from installed entry points.

Registration, looked up in this order by ``resolve_package(env_id, factory)``:

1. a dotted path ``"pkg.module:attr"`` (the config's ``environment.factory``): ``attr`` is an
   ``EnvPackage`` or a callable with no arguments returning one;
2. the built-ins (:data:`BUILTIN`: the terminal tasks, ``terminal-repair-v1``, alias
   ``deterministic_terminal``, and the other packages shipped inside closedloop);
3. entry points of the group ``closedloop.environments`` (``importlib.metadata``), whose name is
   the env id and whose object is as in 1.

The package found must carry the id it was asked for (``EnvPackageError`` otherwise). Importing
this module imports no environment.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from functools import lru_cache
from importlib import metadata
from typing import Any

from closedloop.contracts.package import EnvPackage
from closedloop.errors import EnvPackageError, UnknownEnvironmentError

ENTRY_POINT_GROUP = "closedloop.environments"
DEFAULT_ENV_ID = "terminal-repair-v1"
BUILTIN: Mapping[str, str] = {
    "terminal-repair-v1": "closedloop.envs.terminal.package:terminal_package",
    "keydoor-v1": "closedloop.envs.keydoor.package:keydoor_package",
    "shopping-v1": "closedloop.envs.shopping.package:shopping_package",
    "searchqa-v1": "closedloop.envs.searchqa.package:searchqa_package",
    "frozenlake-v1": "closedloop.envs.gym_bridge.frozenlake:frozenlake_package",
}
"""Packages shipped inside closedloop: env id -> dotted path of the package (or its factory)."""
ALIASES: Mapping[str, str] = {"deterministic_terminal": "terminal-repair-v1"}
"""Other names of built-in ids (``environment.domain: deterministic_terminal``)."""
DOTTED_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


# --------------------------------------------------------------------------- registry
def load_dotted(path: str) -> EnvPackage:
    """Import ``"pkg.module:attr"``; ``attr`` is an ``EnvPackage`` or a no-argument factory."""
    if not isinstance(path, str) or not DOTTED_RE.match(path):
        raise EnvPackageError(f"factory {path!r} is not a dotted path 'pkg.module:attr'")
    module_name, attr = path.split(":", 1)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise EnvPackageError(f"factory {path!r}: cannot import {module_name!r}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise EnvPackageError(f"factory {path!r}: {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    return _as_package(obj, path)


def _as_package(obj: Any, where: str) -> EnvPackage:
    if isinstance(obj, EnvPackage):
        return obj
    if callable(obj):
        try:
            made = obj()
        except Exception as exc:  # a user factory's own error, named
            raise EnvPackageError(f"{where}: calling it raised {type(exc).__name__}: "
                                  f"{exc}") from exc
        if isinstance(made, EnvPackage):
            return made
        raise EnvPackageError(f"{where} returned {type(made).__name__}, not an EnvPackage")
    raise EnvPackageError(f"{where} is {type(obj).__name__}, neither an EnvPackage nor a "
                          "factory of one")


def _entry_points() -> dict[str, metadata.EntryPoint]:
    out: dict[str, metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in out and out[ep.name].value != ep.value:
            raise EnvPackageError(f"entry point {ep.name!r} of {ENTRY_POINT_GROUP!r} is "
                                  f"registered twice: {out[ep.name].value} and {ep.value}")
        out[ep.name] = ep
    return out


def registered() -> dict[str, str]:
    """Every registered id -> where it comes from (``builtin:...`` or ``entry point:...``)."""
    out = {env_id: f"builtin:{path}" for env_id, path in BUILTIN.items()}
    for name, ep in _entry_points().items():
        out.setdefault(name, f"entry point:{ep.value}")
    return out


def canonical_id(env_id: str) -> str:
    """Resolve an alias (``deterministic_terminal``) to its versioned id."""
    return ALIASES.get(env_id, env_id)


@lru_cache(maxsize=32)
def resolve_package(env_id: str | None = None, factory: str | None = None) -> EnvPackage:
    """The package registered as ``env_id`` (default: the terminal tasks), or loaded from
    ``factory``; its ``env_id`` must be the one asked for (see the module docstring)."""
    wanted = canonical_id(env_id) if env_id is not None else None
    if factory is not None:
        package = load_dotted(factory)
        where = f"factory {factory!r}"
    else:
        wanted = wanted or DEFAULT_ENV_ID
        if wanted in BUILTIN:
            package, where = load_dotted(BUILTIN[wanted]), f"built-in {wanted!r}"
        else:
            ep = _entry_points().get(wanted)
            if ep is None:
                known = sorted({*registered(), *ALIASES})
                raise UnknownEnvironmentError(f"no environment package {wanted!r} is registered"
                                              f" (known: {known}; or give environment.factory)")
            package, where = _as_package(ep.load(), f"entry point {ep.value!r}"), ep.value
    if wanted is not None and package.env_id != wanted:
        raise EnvPackageError(f"{where} holds environment {package.env_id!r}, not {wanted!r}")
    return package


def resolve_section(section: Mapping[str, Any] | None) -> EnvPackage:
    """The package a run config's ``environment`` section names (``id`` over ``domain``)."""
    section = section or {}
    env_id, factory = section.get("id"), section.get("factory")
    if env_id is None and factory is None:
        env_id = section.get("domain")
    return resolve_package(None if env_id is None else str(env_id),
                           None if factory is None else str(factory))


def package_for_version(env_version: str) -> EnvPackage | None:
    """The registered package whose ``env_version`` is this (built-ins, then entry points)."""
    for env_id in registered():
        try:
            package = resolve_package(env_id)
        except EnvPackageError:
            continue
        if package.env_version == env_version:
            return package
    return None
