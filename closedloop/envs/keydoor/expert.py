"""Scripted key-and-door policies: an expert that acts on what it observes, and a noisy one.

``KeyDoorExpert`` knows nothing hidden: it inspects, reads the colour from the clue (the only
colour word an ``inspect`` observation holds), keeps the key it holds if it matches or picks up
the other one, opens that door and finishes. It carries the clue across turns itself (the
recurrent memory the task asks of the policy). ``noise_rate`` is the probability, before each of
its planned actions, of first making one recoverable mistake: a malformed call, or picking up
the wrong key (then the right one). Mistakes cost time, so on ``tight`` tasks they fail.
"""

from __future__ import annotations

import re

from closedloop.contracts import Action
from closedloop.envs.sim.experts import ObservingExpert

_COLOUR_RE = re.compile(r"\b(red|blue)\b")
_HOLD_RE = re.compile(r"You hold the (red|blue) key")


class KeyDoorExpert(ObservingExpert):
    """Plays one episode from observations (see the module docstring)."""

    def __init__(self, seed: int = 0, noise_rate: float = 0.0) -> None:
        super().__init__("keydoor-expert", seed, noise_rate)
        self._target: str | None = None
        self._held: str | None = None
        self._queued: list[Action | str] = []
        self._started = False

    def _observe(self, observation: str) -> Action | str | None:
        """Remember the key held and the clue's colour; the queued recovery, if any."""
        held = _HOLD_RE.search(observation)
        if held or "You hold no key" in observation:
            self._held = held.group(1) if held else None
        if self._started and self._target is None and "look around" in observation:
            colours = _COLOUR_RE.findall(observation.split("You hold", 1)[0])
            self._target = colours[0] if colours else None
        self._started = True
        return self._queued.pop(0) if self._queued else None

    def _plan(self, observation: str) -> Action:
        if "is open" in observation:
            return Action.finish()
        if self._target is None:
            return Action.tool("inspect")
        if self._held != self._target:
            return Action.tool(f"pickup_{self._target}")
        return Action.tool(f"open_{self._target}")

    def _mistake(self, planned: Action) -> Action | str:
        if planned.name.startswith("pickup_") and self._rng.random() < 0.5:
            wrong = "blue" if planned.name == "pickup_red" else "red"
            if self._held != wrong:
                self._queued.append(planned)
                return Action.tool(f"pickup_{wrong}")
        self._queued.append(planned)
        return planned.canonical_text()[:-3]  # an unclosed call
