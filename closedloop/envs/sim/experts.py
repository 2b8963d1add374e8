"""The scaffold of the simulated environments' scripted experts (key-and-door, shopping,
SearchQA): the noise-rate contract, the policy's own random stream, and the ``expert`` /
``noisy`` pair a package offers.

``ObservingExpert`` plays from observations. Each turn ``act`` first gives the expert a look
(``_observe``: update what it remembers; return an action to play as is, such as the rest of a
recovery it queued, or None), else asks for its planned action (``_plan``); before a planned
tool call, with probability ``noise_rate``, it makes one recoverable mistake instead
(``_mistake``, which queues what recovers). The draws come from
``random.Random(f"{rng_key}/{seed}")``, the policy's own stream (``seed`` is the policy's noise
seed, not the episode's reset seed).

``expert_and_noisy(make)`` turns ``make(task_id, seed, noise_rate)`` into the package's
``scripted`` map: ``expert`` at noise rate 0, ``noisy`` at the rate asked.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from closedloop.contracts import Action
from closedloop.contracts.package import ScriptedFactory, ScriptedPolicyLike


def check_noise_rate(noise_rate: float) -> float:
    """``noise_rate`` if it is a probability (``ValueError`` otherwise)."""
    if not 0.0 <= noise_rate <= 1.0:
        raise ValueError(f"noise_rate must be in [0, 1], got {noise_rate}")
    return noise_rate


class ObservingExpert:
    """A scripted expert that acts on observations, with recoverable noise (module doc)."""

    def __init__(self, rng_key: str, seed: int = 0, noise_rate: float = 0.0) -> None:
        self.noise_rate = check_noise_rate(noise_rate)
        self._rng = random.Random(f"{rng_key}/{seed}")

    def act(self, observation: str) -> Action | str:
        """The next action for ``observation`` (the env's latest text)."""
        ready = self._observe(observation)
        if ready is not None:
            return ready
        planned = self._plan(observation)
        if planned.kind == "tool" and self._rng.random() < self.noise_rate:
            return self._mistake(planned)
        return planned

    def _observe(self, observation: str) -> Action | str | None:
        """Update what the expert remembers; an action to play without noise, or None."""
        return None

    def _plan(self, observation: str) -> Action:
        """The planned action for this observation."""
        raise NotImplementedError

    def _mistake(self, planned: Action) -> Action | str:
        """A recoverable mistake in place of ``planned`` (queueing what recovers)."""
        raise NotImplementedError


def expert_and_noisy(make: Callable[[str, int, float], ScriptedPolicyLike]
                     ) -> dict[str, ScriptedFactory]:
    """``{"expert": make at noise rate 0, "noisy": make}`` (factories
    ``(task_id, seed, noise_rate) -> policy``)."""
    def expert(task_id: str, seed: int, noise_rate: float) -> ScriptedPolicyLike:
        return make(task_id, seed, 0.0)

    return {"expert": expert, "noisy": make}
