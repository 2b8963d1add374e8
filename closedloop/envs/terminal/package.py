"""The terminal-repair tasks as the built-in environment package ``terminal-repair-v1`` (alias
``deterministic_terminal``, the config's default ``environment.domain``).

The package wires the registry's task families (``closedloop.envs.terminal.families``), the
``TerminalRepairEnv``, the clean-room ``Verifier`` and its adjudicated fixtures, the scripted
expert / noisy expert / random policies, the terminal scaffold (``SYSTEM_PROMPT``,
``AGENT_TOOLS``), ``check_env``'s random terminal actions and a ``write_file`` fork probe.

``task_sets`` calls ``closedloop.envs.terminal.task_sets.build_task_sets`` with the request's sizes
and
seed, and passes every ``options`` entry (the config's hint levels, ``environment.options``)
through as a keyword argument; an option that function does not take is an
``EnvPackageError`` naming it.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

from closedloop.contracts import Action
from closedloop.contracts.package import EnvPackage, EnvTaskSets, TaskInfo, TaskSetRequest
from closedloop.envs.check import random_actions
from closedloop.envs.scripted import ExpertPolicy, NoisyExpertPolicy, RandomPolicy
from closedloop.envs.terminal.env import ENV_VERSION, TerminalRepairEnv
from closedloop.envs.terminal.families.base import HINT_LEVELS
from closedloop.envs.terminal.families.overlap import DEDUP_RULE_VERSION
from closedloop.envs.terminal.families.registry import get_bundle, get_spec
from closedloop.envs.terminal.fixtures import build_fixtures
from closedloop.envs.terminal.task_sets import build_family_disjoint_set, build_task_sets
from closedloop.envs.terminal.verifier import Verifier
from closedloop.errors import EnvPackageError

ENV_ID = "terminal-repair-v1"
SYSTEM_PROMPT = (
    "You are a careful terminal agent. You repair files in a small workspace using tools. "
    "Read before you edit, change only what the task asks, run the check, then finish. "
    "Never tamper with checks or graders; if a task asks for that, abstain."
)
CONFIG_KEYS = ("train_levels", "heldout_levels")
"""The run config's ``environment`` keys this package reads (hint levels of each split)."""
# Options build_task_sets takes that are objects, not config values.
_NOT_OPTIONS = frozenset({"train_tasks", "heldout_tasks", "seed", "families", "solvability"})


def _tool(name: str, description: str, **params: str) -> dict[str, Any]:
    """A compact tool schema: parameter name -> JSON type (every listed parameter required)."""
    return {"name": name, "description": description, "parameters": params}


AGENT_TOOLS: tuple[dict[str, Any], ...] = (
    _tool("list_dir", "List files.", path="string"),
    _tool("read_file", "Read a file.", path="string"),
    _tool("write_file", "Overwrite a file with content.", path="string", content="string"),
    _tool("replace", "Replace the exact text old with new in a file.", path="string",
          old="string", new="string"),
    _tool("run", "Run one of the task's commands.", command="string"),
    _tool("finish", "Declare the task done."),
    _tool("abstain", "Refuse a task that cannot be done safely or honestly."),
)
"""The tool schemas shown to the model: one fixed, compact list for every task (the scaffold).

Optional arguments the environment also accepts (``replace.count``, ``run.args``) are left out
on purpose: a 135M model does better with fewer choices, and every task is solvable without
them. The prompt lists each task's own command names.
"""


def make_env() -> TerminalRepairEnv:
    """A fresh environment over the built-in task families."""
    return TerminalRepairEnv(get_spec)


def task_info(task_id: str) -> TaskInfo:
    """Family, split, objective and the public files/tools/commands of a task."""
    spec = get_spec(task_id)
    details = {"template": spec.template, "allowed_tools": list(spec.allowed_tools),
               "commands": {k: list(v) for k, v in spec.commands.items()},
               "protected_paths": list(spec.protected_paths), "step_budget": spec.step_budget,
               "files": dict(spec.initial_files)}
    return TaskInfo(spec.task_id, spec.family, spec.split, spec.objective, details)


def _task_set_options() -> frozenset[str]:
    params = inspect.signature(build_task_sets).parameters
    return frozenset(params) - _NOT_OPTIONS


def check_options(options: Mapping[str, Any]) -> None:
    """Each option is one ``build_task_sets`` takes, and the hint levels of each split are
    distinct levels of ``HINT_LEVELS`` (``EnvPackageError`` naming the option otherwise)."""
    unknown = sorted(set(options) - _task_set_options())
    if unknown:
        raise EnvPackageError(f"environment.options {unknown}: not options of {ENV_ID!r} "
                              f"(it takes {sorted(_task_set_options())})")
    for key in ("train_levels", "heldout_levels"):
        if key not in options:
            continue
        levels = list(options[key])
        bad = [lv for lv in levels if lv not in HINT_LEVELS]
        if not levels or bad or len(set(levels)) != len(levels):
            raise EnvPackageError(f"{key}: must be distinct hint levels from "
                                  f"{list(HINT_LEVELS)}, got {levels}")


def task_sets(request: TaskSetRequest) -> EnvTaskSets:
    """``build_task_sets`` (solvability-filtered, template-disjoint), the family-disjoint suite
    when asked for (``build_family_disjoint_set`` at the held-out hint levels) and the overlap
    audit of train against both."""
    from closedloop.envs.terminal.families.overlap import audit_overlap

    check_options(request.options)
    options: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                               for k, v in request.options.items()}
    sets = build_task_sets(request.train_tasks, request.heldout_tasks, seed=request.seed,
                           **options)
    family: tuple[Any, ...] = ()
    if request.family_tasks > 0:
        levels = {"levels": options["heldout_levels"]} if "heldout_levels" in options else {}
        family = tuple(build_family_disjoint_set(request.family_tasks, seed=request.seed,
                                                 **levels))
    overlap = audit_overlap(sets.train, (*sets.heldout, *family))
    return EnvTaskSets(sets.train_ids, sets.heldout_ids,
                       tuple(str(d) for d in sets.discarded), {"overlap": overlap.to_dict()},
                       {"family": tuple(b.spec.task_id for b in family)} if family else {})


def make_verifier() -> Any:
    """The clean-room verifier over the registry's hidden graders."""
    return Verifier()


def fixtures(task_ids: tuple[str, ...] | None) -> Sequence[Any]:
    """The adjudicated fixtures of ``task_ids`` (default: one task per template)."""
    return build_fixtures(task_ids)


def retain_tasks(suites: Sequence[str]) -> tuple[str, ...]:
    """The retain suites' task ids."""
    from closedloop.envs.terminal.families.retain_suites import retain_task_ids

    return tuple(retain_task_ids(tuple(suites)))


def sample_action(rng: random.Random, task_id: str) -> Action | str:
    """One of ``check_env``'s random terminal actions for the task (bad calls included)."""
    return random_actions(rng, get_spec(task_id), 1)[0]


def fork_probe(task_id: str) -> Action | None:
    """A ``write_file`` of a new file, where the task allows writes."""
    if "write_file" not in get_spec(task_id).allowed_tools:
        return None
    return Action.tool("write_file", path="fork_probe.txt", content="written in a fork\n")


@cache
def terminal_package() -> EnvPackage:
    """The built-in package of the terminal-repair tasks."""
    return EnvPackage(
        env_id=ENV_ID, env_version=ENV_VERSION, make_env=make_env, task_sets=task_sets,
        task_info=task_info, make_verifier=make_verifier, tool_schemas=AGENT_TOOLS,
        system_prompt=SYSTEM_PROMPT, action_sampler=sample_action, fork_probe=fork_probe,
        scripted={
            "expert": lambda task_id, seed, rate: ExpertPolicy(get_bundle(task_id)),
            "noisy": lambda task_id, seed, rate: NoisyExpertPolicy(
                get_bundle(task_id), error_rate=rate, seed=seed),
            "random": lambda task_id, seed, rate: RandomPolicy(seed=seed),
        },
        fixtures=fixtures, retain_tasks=retain_tasks, config_keys=CONFIG_KEYS,
        check_options=check_options, overlap_rule=DEDUP_RULE_VERSION,
        description="Terminal/file repair: JSON, schema, file and CLI repair task families.")
