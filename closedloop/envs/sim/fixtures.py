"""Adjudicated fixtures for simulated environments: final states played through the real env.

``played_fixture`` resets a fresh environment on the task, plays the given actions (the episode
must end) and labels the exported final state by hand (the caller states the label and its
reason). ``tampered_fixture`` edits the world of such a state and re-encodes it canonically: a
state no action can produce, which the verifier must quarantine (``expect_quarantine``).
``fixtures_per_task`` is the loop every simulated package's ``fixtures`` hook runs: for each
task id, the package's own ``build(task, play)`` with ``play`` bound to a fresh env of its
rules and that task; ``first_tasks`` names the default fixture tasks, the first few of each
template.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from closedloop.contracts import Action, AgentEnv, canonical_json
from closedloop.contracts.fixture import AdjudicatedFixture
from closedloop.contracts.package import Rules
from closedloop.envs.sim.catalog import SimTask, TaskCatalog
from closedloop.envs.sim.env import SimEnv
from closedloop.envs.sim.state import decode_sim_state
from closedloop.errors import EnvError


def played_fixture(make_env: Callable[[], AgentEnv], task: SimTask, kind: str,
                   actions: Sequence[Action | str], label: bool, rationale: str,
                   seed: int = 0) -> AdjudicatedFixture:
    """Play ``actions`` from reset; the episode must end on the last one (``EnvError`` if not)."""
    env = make_env()
    env.reset(task.task_id, seed)
    done = False
    for action in actions:
        if done:
            raise EnvError(f"fixture {kind} of {task.task_id}: actions continue after the end")
        done = env.step(action).done
    if not done:
        raise EnvError(f"fixture {kind} of {task.task_id}: the episode did not end")
    return AdjudicatedFixture(f"{task.task_id}#{kind}", task.task_id, task.family, kind,
                              env.export_state(), label, False, rationale)


def tampered_fixture(base: AdjudicatedFixture,
                     edit: Callable[[dict[str, Any]], Mapping[str, Any]],
                     rationale: str) -> AdjudicatedFixture:
    """``base`` with its world edited by ``edit`` (canonical bytes; must be quarantined)."""
    state = decode_sim_state(base.final_state)
    edited = dataclasses.replace(state, world_json=canonical_json(dict(edit(state.world()))))
    return AdjudicatedFixture(f"{base.task_id}#tamper", base.task_id, base.family, "tamper",
                              edited.to_bytes(), False, True, rationale)


class Play(Protocol):
    """``played_fixture`` bound to one task and a fresh env of its rules."""

    def __call__(self, kind: str, actions: Sequence[Action | str], label: bool,
                 rationale: str) -> AdjudicatedFixture:
        """Play ``actions`` from reset and label the final state (see ``played_fixture``)."""
        ...


def fixtures_per_task(rules: Callable[[], Rules], catalog: TaskCatalog, task_ids: Iterable[str],
                      build: Callable[[SimTask, Play], Iterable[AdjudicatedFixture]]
                      ) -> list[AdjudicatedFixture]:
    """Every task's fixtures, in task order: ``build(task, play)`` per task id, where
    ``play(kind, actions, label, rationale)`` plays on a fresh ``SimEnv(rules())``."""
    def make() -> AgentEnv:
        return SimEnv(rules())

    out: list[AdjudicatedFixture] = []
    for task_id in task_ids:
        task = catalog.task(task_id)

        def play(kind: str, actions: Sequence[Action | str], label: bool, rationale: str,
                 task: SimTask = task) -> AdjudicatedFixture:
            return played_fixture(make, task, kind, actions, label, rationale)

        out += build(task, play)
    return out


def first_tasks(catalog: TaskCatalog, family_id: str, templates: Iterable[str],
                per_template: int) -> tuple[str, ...]:
    """The ids of tasks 0..``per_template``-1 of each template, template by template."""
    return tuple(catalog.generate(family_id, template, i).task_id
                 for template in templates for i in range(per_template))
