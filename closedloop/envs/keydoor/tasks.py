"""Key-and-door tasks (docs/environments.md, built-in packages): family ``keydoor-v1``.

A room has a red and a blue door and a key of each colour. One door is the exit; a clue naming
its colour is seen only after ``inspect``. Public data (what the environment materializes): the
room text, the clue text, the key held at the start. Hidden data (the verifier's only): the
target colour. Templates:

- ``standard`` (train): no key at the start, budget 10 time units;
- ``tight`` (train): no key at the start, budget 6 = inspect 2 + pickup 1 + open 2 + finish 1,
  so any wasted action runs the budget out;
- ``prekeyed`` (held-out): the agent starts holding a key whose colour is independent of the
  target, budget 10; keeping it or swapping it is the agent's choice.
"""

from __future__ import annotations

import random

from closedloop.envs.sim.catalog import SimFamily, TaskCatalog, TaskDraft

FAMILY_ID = "keydoor-v1"
COLOURS: tuple[str, str] = ("red", "blue")
BUDGETS = {"standard": 10, "tight": 6, "prekeyed": 10}

_ROOMS = (
    "You stand in a stone cellar lit by a single candle.",
    "You are in a narrow hallway with a tiled floor.",
    "You wake in a small library; dust hangs in the air.",
    "You are inside a wooden cabin; rain drums on the roof.",
    "You stand in a greenhouse full of wilted ferns.",
    "You are in an empty classroom; the clock has stopped.",
    "You stand in a boiler room; pipes hiss around you.",
    "You are in an attic under a low, sloping roof.",
)
_CLUES = (
    "A {c} lamp glows above the exit.",
    "Chalk on the floor reads: take the {c} door.",
    "A map pinned to the wall marks the {c} door as the way out.",
    "A note on the table says: only the {c} door leads outside.",
    "Fresh footprints lead to the {c} door.",
    "A brass plaque reads: EXIT, with a {c} arrow beneath it.",
)


def _build(template: str, index: int, rng: random.Random) -> TaskDraft:
    room = rng.choice(_ROOMS)
    clue = rng.choice(_CLUES)
    target = rng.choice(COLOURS)
    start_key = rng.choice(COLOURS) if template == "prekeyed" else None
    budget = BUDGETS[template]
    objective = ("Find the exit: open the door the room's clue points to, then finish. "
                 f"Time budget: {budget} units.")
    public = {"room": room, "clue": clue.format(c=target), "start_key": start_key}
    return TaskDraft(objective, public, {"target": target}, budget)


FAMILY = SimFamily(FAMILY_ID, {"standard": "train", "tight": "train", "prekeyed": "heldout"},
                   _build)
CATALOG = TaskCatalog([FAMILY], per_template=16)
"""32 train tasks (standard, tight) and 16 held-out tasks (prekeyed)."""
