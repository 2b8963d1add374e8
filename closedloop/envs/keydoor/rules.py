"""Key-and-door dynamics (docs/environments.md, built-in packages): macro-actions with durations
and phase masks.

World: ``room`` and ``clue`` texts, ``inspected``, the ``key`` held (``red``/``blue``/None) and
the ``door`` opened (None until one is). The rules never hold the target colour: the clue text
carries it, and only ``inspect`` shows the clue, so no other observation depends on it.

Macro-actions and their durations (clock units): ``inspect`` 2, ``pickup_red``/``pickup_blue``
1 (picking one key up puts the other down), ``open_red``/``open_blue`` 2 (needs the key of that
colour; a door once open stays open), ``finish`` 1.

Phase masks (the actions listed as available, and the only ones accepted): no key held:
``inspect, pickup_red, pickup_blue, finish``; key K held, no door open: ``inspect,
pickup_<other>, open_K, finish``; a door open: ``finish``. The mask is a function of the held
key and the open door only, never of the target: it removes meaningless actions without making
the semantic choice. A masked action is the error ``action_masked``; an action with arguments is
``bad_arguments``; any other name ``unknown_tool``; each changes nothing and costs 1 unit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from closedloop.contracts import Action
from closedloop.contracts.package import Opening, Outcome
from closedloop.envs.keydoor.tasks import CATALOG, COLOURS
from closedloop.envs.sim.catalog import TaskCatalog
from closedloop.envs.sim.env import error_outcome
from closedloop.errors import TaskError

ENV_VERSION = "keydoor-v1"
ACTIONS: tuple[str, ...] = ("inspect", "pickup_red", "pickup_blue", "open_red", "open_blue",
                            "finish")
DURATIONS: Mapping[str, int] = {"inspect": 2, "pickup_red": 1, "pickup_blue": 1,
                                "open_red": 2, "open_blue": 2, "finish": 1}


def available(world: Mapping[str, Any]) -> tuple[str, ...]:
    """The phase mask: actions available in ``world`` (held key and open door only)."""
    if world["door"] is not None:
        return ("finish",)
    key = world["key"]
    if key is None:
        return ("inspect", "pickup_red", "pickup_blue", "finish")
    other = next(c for c in COLOURS if c != key)
    return ("inspect", f"pickup_{other}", f"open_{key}", "finish")


def status(world: Mapping[str, Any]) -> str:
    """The visible status line and the mask (never the target)."""
    held = "no key" if world["key"] is None else f"the {world['key']} key"
    door = "" if world["door"] is None else f" The {world['door']} door is open."
    return f"You hold {held}.{door} Available actions: {', '.join(available(world))}."


class KeyDoorRules:
    """The ``Rules`` of ``keydoor-v1`` over a task catalog."""

    env_version = ENV_VERSION

    def __init__(self, catalog: TaskCatalog = CATALOG) -> None:
        self.catalog = catalog

    def opening(self, task_id: str, seed: int) -> Opening:
        """The world of ``task_id`` (the seed changes nothing: the room is fixed by the task)."""
        task = self.catalog.task(task_id)
        return opening_from(task.public, task.objective, task.budget)

    def apply(self, world: Mapping[str, Any], action: Action) -> Outcome:
        """Apply one macro-action (see the module docstring)."""
        name = action.name
        if name not in ACTIONS:
            return error_outcome("unknown_tool", f"unknown action {name!r}; actions: "
                                 f"{', '.join(ACTIONS)}")
        if action.args:
            return error_outcome("bad_arguments", f"{name} takes no arguments")
        if name not in available(world):
            return error_outcome("action_masked", f"{name} is not available now; available: "
                                 f"{', '.join(available(world))}")
        new = dict(world)
        if name == "inspect":
            new["inspected"] = True
            text = f"You look around carefully. {world['clue']}"
        elif name.startswith("pickup_"):
            colour = name.removeprefix("pickup_")
            put_down = f"You put down the {world['key']} key and " if world["key"] else "You "
            new["key"] = colour
            text = f"{put_down}pick up the {colour} key."
        else:
            colour = name.removeprefix("open_")
            new["door"] = colour
            text = f"You unlock the {colour} door and it swings open."
        return Outcome(f"{text} {status(new)}", world=new, cost=DURATIONS[name])


def opening_from(public: Mapping[str, Any], objective: str, budget: int) -> Opening:
    """The world and first observation for a task's public data."""
    start_key = public["start_key"]
    if start_key not in (None, *COLOURS):
        raise TaskError(f"keydoor task: start_key {start_key!r} is not red, blue or null")
    world = {"room": public["room"], "clue": public["clue"], "inspected": False,
             "key": start_key, "door": None}
    costs = ", ".join(f"{a} {d}" for a, d in DURATIONS.items() if a not in
                      ("pickup_blue", "open_blue"))
    text = (f"{public['room']} There is a red door and a blue door, and a key of each colour. "
            f"{objective} Action durations: {costs} (same for blue). {status(world)}")
    return Opening(world, budget, text)
