"""Key-and-door for small non-LLM policies: the feature codec and the shaping potential.

``KeyDoorCodec`` (the package's ``FeatureCodec``) reads the observation text only. Features
(0/1, in this order):

0. ``error``: the observation is a structured error;
1. ``clue_red`` / 2. ``clue_blue``: the observation is an ``inspect`` result whose clue names
   that colour (the only place the exit colour ever appears: a recurrent policy must keep it);
3. ``hold_red`` / 4. ``hold_blue``: the status line says that key is held;
5. ``door_open``: the status line says a door is open;
6–11. ``avail_<action>``: the action is listed as available (the phase mask, never the target).

``strata(task_id)`` labels a task's template and exit colour for grouping evaluation results.
``potential(task_id, state_bytes)`` is Φ over the true state (the world and the task's hidden
target): Φ = 0.2·inspected + 0.3·[key held = target] + 0.5·[door open = target], in [0, 1].
The shaping module sets Φ of a terminal state to 0 itself.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from closedloop.contracts import Action
from closedloop.envs.keydoor.rules import ACTIONS
from closedloop.envs.keydoor.tasks import CATALOG, COLOURS
from closedloop.envs.sim.state import decode_sim_state
from closedloop.errors import TaskError

_AVAILABLE_RE = re.compile(r"Available actions: ([a-z_, ]+)\.")
_HOLD_RE = re.compile(r"You hold the (red|blue) key")
_INSPECT_PREFIX = "You look around carefully."
FEATURE_NAMES: tuple[str, ...] = ("error", "clue_red", "clue_blue", "hold_red", "hold_blue",
                                  "door_open", *(f"avail_{a}" for a in ACTIONS))


class KeyDoorCodec:
    """The ``FeatureCodec`` of ``keydoor-v1`` (see the module docstring)."""

    version = "keydoor-features-v1"
    actions: tuple[str, ...] = ACTIONS
    n_features = len(FEATURE_NAMES)

    def features(self, observation: str) -> tuple[int, ...]:
        """The 0/1 feature vector of one observation (module docstring order)."""
        error = observation.lstrip().startswith('{"error"')
        clue = ""
        if observation.startswith(_INSPECT_PREFIX):
            clue = observation[len(_INSPECT_PREFIX):].split("You hold", 1)[0]
        held = _HOLD_RE.search(observation)
        m = _AVAILABLE_RE.search(observation)
        listed = set() if m is None else {a.strip() for a in m.group(1).split(",")}
        mask = [a in listed for a in ACTIONS]
        bits = [error, "red" in clue, "blue" in clue, bool(held and held.group(1) == "red"),
                bool(held and held.group(1) == "blue"), "door is open" in observation, *mask]
        return tuple(int(b) for b in bits)

    def action_mask(self, features: Sequence[int]) -> tuple[bool, ...] | None:
        """The ``avail_*`` features, or ``None`` when none is set (an error lists none)."""
        avail = tuple(bool(b) for b in features[-len(ACTIONS):])
        return avail if any(avail) else None

    def action(self, index: int) -> Action:
        """``finish`` or the tool call of ``ACTIONS[index]``."""
        name = ACTIONS[index]
        return Action.finish() if name == "finish" else Action.tool(name)


def potential(task_id: str, state_bytes: bytes) -> float:
    """Φ of the module docstring, from an exported key-and-door state."""
    world = decode_sim_state(state_bytes).world()
    target = CATALOG.task(task_id).hidden["target"]
    if target not in COLOURS:
        raise TaskError(f"task {task_id}: target {target!r} is not a colour")
    return (0.2 * bool(world["inspected"]) + 0.3 * (world["key"] == target)
            + 0.5 * (world["door"] == target))


def strata(task_id: str) -> dict[str, str]:
    """Evaluation strata of a task: its template and its exit colour (hidden data: for grouping
    results, never shown to a policy)."""
    task = CATALOG.task(task_id)
    return {"template": task.template, "exit": str(task.hidden["target"])}
