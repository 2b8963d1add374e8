"""Adjudicated fixtures for simulated environments: final states played through the real env.

``played_fixture`` resets a fresh environment on the task, plays the given actions (the episode
must end) and labels the exported final state by hand (the caller states the label and its
reason). ``tampered_fixture`` edits the world of such a state and re-encodes it canonically: a
state no action can produce, which the verifier must quarantine (``expect_quarantine``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from closedloop.contracts import Action, AgentEnv, canonical_json
from closedloop.contracts.fixture import AdjudicatedFixture
from closedloop.envs.sim.catalog import SimTask
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
