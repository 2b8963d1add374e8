"""An ``EnvPackage`` (``closedloop.envs.discovery``) for a simulated environment over a catalog.

``sim_package`` derives the catalog-shaped parts every simulated environment shares:

- ``task_sets(request)``: ``request.train_tasks`` / ``request.heldout_tasks`` ids drawn round
  robin over the split's templates; each template's indices are a seeded permutation of its
  index space (``random.Random(f"{family}/{template}/{seed}")``), so the sets are
  template-disjoint and a function of the request alone; asking for more tasks than the split
  has is an ``EnvPackageError``. The package takes no ``options``
  (an option is an ``EnvPackageError`` naming it).
- ``task_info(task_id)``: family, split, the objective and ``{template, budget}``; never the
  public world data (a clue the model has not yet been shown) nor the hidden data.

Everything environment-specific (rules, verifier, scaffold, sampler, probe, scripted policies,
fixtures) is passed in; ``closedloop.envs.sim.simple.rules_package`` derives most of it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from closedloop.contracts.package import (
    ActionSampler,
    EnvPackage,
    EnvTaskSets,
    ForkProbe,
    Rules,
    ScriptedFactory,
    TaskInfo,
    TaskSetRequest,
)
from closedloop.envs.sim.catalog import TaskCatalog
from closedloop.envs.sim.env import SimEnv
from closedloop.envs.task_records import Split
from closedloop.errors import EnvPackageError


def draw_task_ids(catalog: TaskCatalog, split: Split, n: int, seed: int) -> tuple[str, ...]:
    """``n`` distinct task ids of ``split``, round robin over its templates (see above)."""
    slots = [(f.family_id, t, f.indices(t)) for f in catalog.families.values()
             for t, s in f.templates.items() if s == split]
    available = sum(size for _, _, size in slots)
    if n < 0 or n > available:
        raise EnvPackageError(f"cannot draw {n} {split} tasks: the split has {available}")
    orders = [random.Random(f"{family}/{template}/{seed}").sample(range(size), size)
              for family, template, size in slots]
    out: list[str] = []
    depth = 0
    while len(out) < n:
        for (family, template, _), order in zip(slots, orders, strict=True):
            if len(out) < n and depth < len(order):
                out.append(catalog.generate(family, template, order[depth]).task_id)
        depth += 1
    return tuple(out)


def catalog_task_sets(catalog: TaskCatalog, request: TaskSetRequest) -> EnvTaskSets:
    """The request's train and held-out ids (no options are accepted)."""
    if request.options:
        raise EnvPackageError(f"environment.options {sorted(request.options)}: this package "
                              "takes no options")
    return EnvTaskSets(draw_task_ids(catalog, "train", request.train_tasks, request.seed),
                       draw_task_ids(catalog, "heldout", request.heldout_tasks, request.seed))


def catalog_task_info(catalog: TaskCatalog, task_id: str) -> TaskInfo:
    """Family, split, objective, template and budget of a task."""
    task = catalog.task(task_id)
    return TaskInfo(task.task_id, task.family, task.split, task.objective,
                    {"template": task.template, "budget": task.budget})


def sim_package(*, env_id: str, rules: Callable[[], Rules], catalog: TaskCatalog,
                make_verifier: Callable[[], Any], tool_schemas: tuple[Mapping[str, Any], ...],
                system_prompt: str, action_sampler: ActionSampler, fork_probe: ForkProbe | None,
                scripted: Mapping[str, ScriptedFactory],
                fixtures: Callable[[tuple[str, ...] | None], Sequence[Any]] | None,
                description: str) -> EnvPackage:
    """The ``EnvPackage`` of one simulated environment (see the module docstring)."""
    env_version = rules().env_version
    return EnvPackage(
        env_id=env_id, env_version=env_version, make_env=lambda: SimEnv(rules()),
        task_sets=lambda request: catalog_task_sets(catalog, request),
        task_info=lambda task_id: catalog_task_info(catalog, task_id),
        make_verifier=make_verifier, tool_schemas=tool_schemas, system_prompt=system_prompt,
        action_sampler=action_sampler, fork_probe=fork_probe, scripted=scripted,
        fixtures=fixtures, description=description)
