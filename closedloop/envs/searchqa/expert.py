"""Scripted SearchQA policies: the gold plan (expert) and a noisy expert.

``SearchQAExpert(task)`` plays the task's hidden gold queries in order, then answers with the
gold answer's first form: a demonstration in the model's action format. Its queries are checked
to retrieve their evidence (tests), so it solves every task. ``noise_rate`` is the probability,
before each gold search, of one recoverable detour: a malformed call, or a search for the
question's first words (then the gold query).
"""

from __future__ import annotations

import random

from closedloop.contracts import Action
from closedloop.envs.sim.catalog import SimTask
from closedloop.envs.sim.experts import check_noise_rate


class SearchQAExpert:
    """Plays one episode of ``task`` (see the module docstring)."""

    def __init__(self, task: SimTask, seed: int = 0, noise_rate: float = 0.0) -> None:
        check_noise_rate(noise_rate)
        rng = random.Random(f"searchqa-expert/{seed}/{task.task_id}")
        plan: list[Action | str] = []
        for query in task.hidden["gold_queries"]:
            gold = Action.tool("search", query=query)
            if rng.random() < noise_rate:
                detour: Action | str = (gold.canonical_text()[:-4] if rng.random() < 0.5 else
                                        Action.tool("search", query=" ".join(
                                            task.objective.split()[:3])))
                plan.append(detour)
            plan.append(gold)
        plan.append(Action.tool("answer", text=task.hidden["answers"][0]))
        self._plan = plan

    def act(self, observation: str) -> Action | str:
        """The plan's next action (``abstain`` past its end)."""
        return self._plan.pop(0) if self._plan else Action.abstain()
