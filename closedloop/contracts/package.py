"""The environment package contract: ``EnvPackage``, one frozen record per environment, with
the requests and records it answers, and the simple route to an environment (``Rules``).

An environment package provides everything a run, ``check_env``, the gates and the CLI take
from an environment; nothing outside the package knows its tasks, tools or verifier. Its fields
(docs/environments.md has the guide, with an example):

- ``env_id`` (versioned, ``lockbox-v1``) and ``env_version`` (what its ``AgentEnv`` records);
- ``make_env() -> AgentEnv`` (``closedloop.contracts.transition``); an env that also implements
  ``SealingEnv`` seals its terminal states (the seal gate checks it, or says it cannot);
- ``task_sets(TaskSetRequest) -> EnvTaskSets``: train / held-out task ids (versioned family
  ids, content-hashed task ids), and ``task_info(task_id) -> TaskInfo``: family, split and the
  public objective text (never hidden grader data);
- ``make_verifier() -> TaskVerifier`` (``closedloop.contracts.verification``): scores a task
  from the exported state bytes only, returning a ``ScoreResult``;
- ``tool_schemas`` and ``system_prompt``: the scaffold the renderer shows the model (hashed into
  every ``PolicyManifest``). A tool schema is a mapping with a unique ``name``, a
  ``description`` and ``parameters`` (argument name -> JSON type name), rendered as given;
- ``action_sampler(rng, task_id) -> Action | str`` for ``check_env``, and
  ``fork_probe(task_id) -> Action | str | None``: a state-changing action of the env's own for
  fork checks (``None``: the env offers none);
- optionally ``scripted`` policies by kind (``expert``, ``noisy``, ``random``): factories
  ``(task_id, seed, noise_rate) -> policy`` with ``act(observation) -> Action | str``, used for
  warm starts and ``closedloop play``; ``seed`` is the policy's own noise seed;
  ``fixtures(task_ids | None)``: adjudicated exported states
  (``closedloop.contracts.fixture.AdjudicatedFixture``) for the verifier FP/FN gate;
  ``retain_tasks(suites)``: retain-suite task ids; ``config_keys``: the package's own keys of
  the config's ``environment`` section, passed to ``task_sets`` in ``TaskSetRequest.options``;
  ``check_options(options)``: validates those options when the config is loaded;
  ``overlap_rule``: the version of the held-out overlap rule its task sets' audit implements
  (``EnvTaskSets.audit["overlap"]``, read by the ``heldout_overlap`` gate; the config's
  ``evaluation.dedup_rule_version`` must name it). ``None``: the package declares no overlap
  audit.
  ``feature_codec``: a ``FeatureCodec`` turning observations into fixed-length 0/1 feature
  vectors and macro-action indices into actions, for small non-LLM policies (the recurrent
  actor-critic of docs/credit.md); ``potential(task_id, state_bytes) -> float``: the
  environment's shaping potential Φ over its exported (true) state, hidden task data allowed,
  for potential-based shaping (the terminal convention Φ = 0 is the shaping module's, not the
  package's); ``task_strata(task_id) -> {name: label}``: labels an evaluation groups a task's
  results by (key-and-door's exit colour), hidden task data allowed (never shown to a policy).

The simple route: write a ``Rules`` (``opening(task_id, seed) -> Opening`` and
``apply(world, action) -> Outcome`` over a plain JSON world) and ``closedloop.envs.sim`` turns it
into an ``AgentEnv`` with parsing, budgets, snapshots, forks and sealing done the same way for
every rule set (``SimEnv``), and into a package (``sim_package``).

This module imports nothing above the contracts.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from closedloop.contracts.action import Action
from closedloop.contracts.fixture import AdjudicatedFixture
from closedloop.contracts.termination import Termination
from closedloop.contracts.transition import AgentEnv
from closedloop.contracts.verification import GuardedVerifier, TaskVerifier, guarded
from closedloop.errors import EnvPackageError

ENV_ID_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]*-v[0-9]+$")
"""A versioned environment id: ``lockbox-v1``."""
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
Potential = Callable[[str, bytes], float]
"""``(task_id, exported state bytes) -> Φ``: a shaping potential over the true state."""


class FeatureCodec(Protocol):
    """Observations as fixed-length 0/1 feature vectors, macro-actions by index.

    ``features(observation)`` has ``n_features`` entries, each 0 or 1, and is a function of the
    observation text alone (never of hidden state); ``action_mask(features)`` says which of
    ``actions`` an observation with those features offers (``None`` when it does not say: all
    are allowed), so a policy that reads only features can mask; ``action(index)`` is the
    ``Action`` of ``actions[index]``. ``version`` names the codec (hashed into the manifest of a
    policy that reads it).
    """

    version: str
    actions: tuple[str, ...]
    n_features: int

    def features(self, observation: str) -> tuple[int, ...]:
        """The 0/1 feature vector of one observation."""
        ...

    def action_mask(self, features: Sequence[int]) -> tuple[bool, ...] | None:
        """Which actions an observation with ``features`` offers, or ``None`` when it does
        not say."""
        ...

    def action(self, index: int) -> Action:
        """The action ``actions[index]``."""
        ...


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
    audit: JSON values written into the run's ``tasks.json``. ``overlap``, when the package
    declares an overlap rule (``EnvPackage.overlap_rule``), is the train / held-out overlap
    audit the ``heldout_overlap`` gate reads: ``dedup_rule_version``, ``n_train``,
    ``n_heldout``, ``exact_pairs`` and ``near_pairs`` (lists of ``{train_id, heldout_id,
    similarity}``: a held-out task that duplicates or near-duplicates a train task),
    ``shared_templates`` (template leakage), ``threshold`` and ``max_similarity``.
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
    check_options: Callable[[Mapping[str, Any]], None] | None = None
    overlap_rule: str | None = None
    feature_codec: FeatureCodec | None = None
    potential: Potential | None = None
    task_strata: Callable[[str], Mapping[str, str]] | None = None

    def __post_init__(self) -> None:
        where = f"environment package {self.env_id!r}"
        if not isinstance(self.env_id, str) or not ENV_ID_RE.match(self.env_id):
            raise EnvPackageError(f"{where}: env_id must be a versioned id like 'lockbox-v1'")
        if not isinstance(self.env_version, str) or not self.env_version:
            raise EnvPackageError(f"{where}: env_version must be a non-empty string")
        for name in ("make_env", "task_sets", "task_info", "make_verifier"):
            if not callable(getattr(self, name)):
                raise EnvPackageError(f"{where}: {name} must be callable")
        for name in ("action_sampler", "fork_probe", "fixtures", "retain_tasks",
                     "check_options", "potential", "task_strata"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise EnvPackageError(f"{where}: {name} must be callable or None")
        if not isinstance(self.system_prompt, str) or not self.system_prompt.strip():
            raise EnvPackageError(f"{where}: system_prompt must be non-empty text")
        _check_schemas(where, self.tool_schemas)
        if self.overlap_rule is not None and (not isinstance(self.overlap_rule, str)
                                              or not self.overlap_rule):
            raise EnvPackageError(f"{where}: overlap_rule must be a non-empty version string "
                                  "or None")
        unknown = sorted(set(self.scripted) - set(SCRIPTED_KINDS))
        if unknown or not all(callable(f) for f in self.scripted.values()):
            raise EnvPackageError(f"{where}: scripted maps {list(SCRIPTED_KINDS)} to "
                                  f"factories (unknown kinds {unknown})")

    @property
    def tool_names(self) -> tuple[str, ...]:
        """The names of the tools in ``tool_schemas``, in order."""
        return tuple(str(s["name"]) for s in self.tool_schemas)

    def validate_options(self, options: Mapping[str, Any]) -> None:
        """Check a run's options (``TaskSetRequest.options``) before anything runs:
        ``check_options`` when the package has one (``EnvPackageError`` naming the option)."""
        if self.check_options is not None:
            self.check_options(options)

    def verifier(self) -> GuardedVerifier:
        """A fresh verifier, guarded: its declared failures become unscored results; any other
        error it raises stops the run (``closedloop.contracts.verification``)."""
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


# --------------------------------------------------------------------------- the Rules route
@dataclass(frozen=True)
class Opening:
    """What the rules produce at reset: the world, the time budget and the first observation."""

    world: Mapping[str, Any]
    budget: int
    observation: str


@dataclass(frozen=True)
class Outcome:
    """The result of one tool action under the rules.

    world: the new world, or ``None`` when the action changed nothing. cost: clock units the
    action took (>= 1). end: a termination code when the action ends the episode; final_action
    names that action in the state (``buy``, ``answer``).
    """

    observation: str
    error: str | None = None
    world: Mapping[str, Any] | None = None
    cost: int = 1
    end: Termination | None = None
    final_action: str | None = None


class Rules(Protocol):
    """The pure dynamics of one simulated environment (``closedloop.envs.sim.SimEnv`` runs
    them)."""

    env_version: str

    def opening(self, task_id: str, seed: int) -> Opening:
        """Build the world of ``task_id`` at ``seed`` (``TaskError`` for an unknown task)."""
        ...

    def apply(self, world: Mapping[str, Any], action: Action) -> Outcome:
        """Apply one tool action to ``world`` (a fresh copy the rules may keep)."""
        ...
