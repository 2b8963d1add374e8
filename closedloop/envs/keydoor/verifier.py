"""The key-and-door verifier: reads the exported state and the task's hidden target only.

``task_success`` = 1.0 when the open door is the target colour and the episode ended by
``finish`` (an ``abstain`` or a run-out budget fails), else 0.0. Extra components: ``inspected``
(0/1), ``wrong_door`` (1.0 if a non-target door was opened). A world whose room or clue differ
from the task's is tampering (unscored).
"""

from __future__ import annotations

from closedloop.envs.keydoor.rules import ENV_VERSION
from closedloop.envs.keydoor.tasks import CATALOG, COLOURS
from closedloop.envs.sim.catalog import SimTask, TaskCatalog
from closedloop.envs.sim.scoring import Grade, SimVerifier, world_field
from closedloop.envs.sim.state import SimState

VERIFIER_VERSION = "keydoor-verifier-v1"


def grade(task: SimTask, state: SimState) -> Grade:
    """Decide one episode (see the module docstring)."""
    world = state.world()
    door = world_field(world, "door", (str, type(None)))
    inspected = world_field(world, "inspected", bool)
    target = task.hidden["target"]
    finished = state.done and state.final_action == "finish"
    success = finished and door == target
    reason = ("ok" if success else "no door opened" if door is None
              else f"opened the {door} door, the exit is {target}" if door != target
              else f"ended by {state.final_action or state.termination}, not finish")
    return Grade(float(success), {"inspected": float(inspected),
                                  "wrong_door": float(door in COLOURS and door != target)},
                 reason)


def public_check(task: SimTask, state: SimState) -> str | None:
    """Tampering evidence: the world's room or clue are not the task's."""
    world = state.world()
    for key in ("room", "clue"):
        if world.get(key) != task.public[key]:
            return f"world field {key!r} differs from the task's"
    return None


def make_verifier(catalog: TaskCatalog = CATALOG) -> SimVerifier:
    """The ``TaskVerifier`` of ``keydoor-v1``."""
    return SimVerifier(catalog, ENV_VERSION, grade, public_check, VERIFIER_VERSION)
