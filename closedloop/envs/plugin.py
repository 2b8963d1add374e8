"""The environment plug-in contract: ``EnvPackage``, one frozen record per environment, and the
registry that finds packages by id.

An environment package provides everything a run, ``check_env``, the gates and the CLI take
from an environment; nothing outside the package knows its tasks, tools or verifier:

- ``env_id`` (versioned, ``lockbox-v1``) and ``env_version`` (what its ``AgentEnv`` records);
- ``make_env() -> AgentEnv`` (``closedloop.contracts.transition``); an env that also implements
  ``SealingEnv`` seals its terminal states (the seal gate checks it, or says it cannot);
- ``task_sets(TaskSetRequest) -> EnvTaskSets``: train / held-out task ids (versioned family
  ids, content-hashed task ids), and ``task_info(task_id) -> TaskInfo``: family, split and the
  public objective text (never hidden grader data);
- ``make_verifier() -> TaskVerifier`` (``closedloop.contracts.verification``): scores a task
  from the exported state bytes only, returning a ``ScoreResult``;
- ``tool_schemas`` and ``system_prompt``: the scaffold the renderer shows the model (hashed into
  every ``PolicyManifest``);
- ``action_sampler(rng, task_id) -> Action | str`` for ``check_env``, and
  ``fork_probe(task_id) -> Action | str | None``: a state-changing action of the env's own for
  fork checks (``None``: the env offers none; ``check_env`` then says so by name);
- optionally ``scripted`` policies by kind (``expert``, ``noisy``, ``random``): factories
  ``(task_id, seed, noise_rate) -> policy`` with ``act(observation) -> Action | str``, used for
  warm starts and ``closedloop play``; ``fixtures(task_ids | None)``: adjudicated exported
  states (``closedloop.contracts.fixture.AdjudicatedFixture``) for the verifier FP/FN gate;
  ``retain_tasks(suites)``: retain-suite task ids; ``config_keys``: the package's own keys of
  the config's ``environment`` section (the terminal tasks' hint levels), passed to
  ``task_sets`` in ``TaskSetRequest.options``.

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
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import metadata
from typing import Any, Protocol

from closedloop.contracts import Action, AgentEnv, GuardedVerifier, TaskVerifier, guarded
from closedloop.contracts.fixture import AdjudicatedFixture
from closedloop.errors import EnvPackageError, UnknownEnvironmentError

ENTRY_POINT_GROUP = "closedloop.environments"
DEFAULT_ENV_ID = "terminal-repair-v1"
BUILTIN: Mapping[str, str] = {
    "terminal-repair-v1": "closedloop.verify.terminal_package:terminal_package",
    "keydoor-v1": "closedloop.envs.keydoor.package:keydoor_package",
    "shopping-v1": "closedloop.envs.shopping.package:shopping_package",
    "searchqa-v1": "closedloop.envs.searchqa.package:searchqa_package",
    "frozenlake-v1": "closedloop.envs.gym_bridge.frozenlake:frozenlake_package",
}
"""Packages shipped inside closedloop: env id -> dotted path of the package (or its factory)."""
ALIASES: Mapping[str, str] = {"deterministic_terminal": "terminal-repair-v1"}
"""Other names of built-in ids (``environment.domain: deterministic_terminal``)."""
ENV_ID_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]*-v[0-9]+$")
DOTTED_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
SCRIPTED_KINDS = ("expert", "noisy", "random")


class ScriptedPolicyLike(Protocol):
    """A scripted policy: the next action (or raw model-like text) for an observation."""

    def act(self, observation: str) -> Action | str:
        """Return the next action or text."""
        ...


ActionSampler = Callable[[random.Random, str], Action | str]
"""``(rng, task_id) -> action``: one random action of the env's own for ``check_env``."""
ForkProbe = Callable[[str], Action | str | None]
"""``task_id -> action``: a state-changing action for fork checks, ``None`` if there is none."""
ScriptedFactory = Callable[[str, int, float], ScriptedPolicyLike]
"""``(task_id, seed, noise_rate) -> policy`` playing one episode."""


@dataclass(frozen=True)
class TaskSetRequest:
    """What a run asks of ``task_sets``: sizes, the task seed and package-specific options.

    family_tasks: the size of the family-disjoint suite (families never trained on) the run
    evaluates, 0 for none; a package without such families raises ``EnvPackageError`` when
    asked for one. options: the config's ``environment.options`` plus the environment keys the
    package declares in ``EnvPackage.config_keys``; a package rejects an option it does not
    know (``EnvPackageError`` naming it).
    """

    train_tasks: int
    heldout_tasks: int
    seed: int = 0
    family_tasks: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EnvTaskSets:
    """A package's train and held-out task ids (disjoint), and what it set aside on the way.

    suites: further evaluation suites by name (``family``: the family-disjoint suite), each
    disjoint from ``train``. discarded: notes on candidates a solvability filter rejected.
    audit: JSON values written into the run's ``tasks.json`` (e.g. ``{"overlap": ...}``).
    """

    train: tuple[str, ...]
    heldout: tuple[str, ...]
    discarded: tuple[str, ...] = ()
    audit: Mapping[str, Any] = field(default_factory=dict)
    suites: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        named = {"train": self.train, "heldout": self.heldout, **self.suites}
        for name, ids in named.items():
            if not isinstance(ids, tuple) or not all(isinstance(t, str) and t for t in ids):
                raise EnvPackageError(f"task sets: {name} must be a tuple of task id strings")
            if len(set(ids)) != len(ids):
                raise EnvPackageError(f"task sets: {name} repeats a task id")
            both = sorted(set(self.train) & set(ids)) if name != "train" else []
            if both:
                raise EnvPackageError(f"task sets: {both[:3]} are in both train and {name}")


@dataclass(frozen=True)
class TaskInfo:
    """The public description of one task (what ``closedloop tasks show`` prints).

    family: the versioned family id (``json-repair-v1``); split: ``train``, ``heldout`` or the
    package's own name for other sets (retain suites); objective: the task text shown to the
    model; details: further public fields as JSON values (files, tools, budget).
    """

    task_id: str
    family: str
    split: str
    objective: str
    details: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EnvPackage:
    """One environment package (see the module docstring for each field's contract)."""

    env_id: str
    env_version: str
    make_env: Callable[[], AgentEnv]
    task_sets: Callable[[TaskSetRequest], EnvTaskSets]
    task_info: Callable[[str], TaskInfo]
    make_verifier: Callable[[], TaskVerifier]
    tool_schemas: tuple[Mapping[str, Any], ...]
    system_prompt: str
    action_sampler: ActionSampler | None = None
    fork_probe: ForkProbe | None = None
    scripted: Mapping[str, ScriptedFactory] = field(default_factory=dict)
    fixtures: Callable[[tuple[str, ...] | None], Sequence[AdjudicatedFixture]] | None = None
    retain_tasks: Callable[[Sequence[str]], tuple[str, ...]] | None = None
    config_keys: tuple[str, ...] = ()
    description: str = ""

    def __post_init__(self) -> None:
        where = f"environment package {self.env_id!r}"
        if not isinstance(self.env_id, str) or not ENV_ID_RE.match(self.env_id):
            raise EnvPackageError(f"{where}: env_id must be a versioned id like 'lockbox-v1'")
        if not isinstance(self.env_version, str) or not self.env_version:
            raise EnvPackageError(f"{where}: env_version must be a non-empty string")
        for name in ("make_env", "task_sets", "task_info", "make_verifier"):
            if not callable(getattr(self, name)):
                raise EnvPackageError(f"{where}: {name} must be callable")
        for name in ("action_sampler", "fork_probe", "fixtures", "retain_tasks"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise EnvPackageError(f"{where}: {name} must be callable or None")
        if not isinstance(self.system_prompt, str) or not self.system_prompt.strip():
            raise EnvPackageError(f"{where}: system_prompt must be non-empty text")
        _check_schemas(where, self.tool_schemas)
        unknown = sorted(set(self.scripted) - set(SCRIPTED_KINDS))
        if unknown or not all(callable(f) for f in self.scripted.values()):
            raise EnvPackageError(f"{where}: scripted maps {list(SCRIPTED_KINDS)} to "
                                  f"factories (unknown kinds {unknown})")

    @property
    def tool_names(self) -> tuple[str, ...]:
        """The names of the tools in ``tool_schemas``, in order."""
        return tuple(str(s["name"]) for s in self.tool_schemas)

    def verifier(self) -> GuardedVerifier:
        """A fresh verifier, guarded: its own errors become unscored results, never raise."""
        return guarded(self.make_verifier())

    def family_split(self, task_id: str) -> tuple[str, str]:
        """(family, split) of a task (what the collector records per trajectory)."""
        info = self.task_info(task_id)
        return info.family, info.split

    def scripted_policy(self, kind: str, task_id: str, seed: int,
                        noise_rate: float = 0.0) -> ScriptedPolicyLike:
        """The ``kind`` scripted policy for one episode (``EnvPackageError`` if not offered)."""
        factory = self.scripted.get(kind)
        if factory is None:
            raise EnvPackageError(f"environment package {self.env_id!r} offers no {kind!r} "
                                  f"scripted policy (it offers {sorted(self.scripted)})")
        return factory(task_id, seed, noise_rate)

    def missing(self) -> tuple[str, ...]:
        """Names of the optional parts this package does not offer."""
        out = [name for name in ("action_sampler", "fork_probe", "fixtures", "retain_tasks")
               if getattr(self, name) is None]
        out += [f"scripted.{k}" for k in SCRIPTED_KINDS if k not in self.scripted]
        return tuple(out)


def _check_schemas(where: str, schemas: Any) -> None:
    if not isinstance(schemas, tuple) or not schemas:
        raise EnvPackageError(f"{where}: tool_schemas must be a non-empty tuple of mappings")
    names = []
    for i, schema in enumerate(schemas):
        if not isinstance(schema, Mapping) or not isinstance(schema.get("name"), str):
            raise EnvPackageError(f"{where}: tool_schemas[{i}] must be a mapping with a 'name'")
        names.append(schema["name"])
    if len(set(names)) != len(names):
        raise EnvPackageError(f"{where}: tool_schemas repeat a tool name")


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
