"""The short Rules route: an ``EnvPackage`` from rules, a catalog, a grade and an expert plan.

``rules_package`` assembles what ``sim_package`` needs from the few parts only the environment's
author can write, and derives the rest the same way for every environment:

- the verifier: ``SimVerifier`` (clean-room: exported bytes in, a ``ScoreResult`` out; a state of
  another task, env version or budget is tampering) over ``grade(task, state)``, which returns a
  ``Grade``, a bool or a float ``task_success`` in [0, 1];
- the ``check_env`` sampler (:func:`tool_sampler`): the declared tools called with random
  arguments of their declared types (in and out of range), sometimes an unknown tool;
- the scripted policies (:func:`planned_policies`) from ``expert(task) -> [Action | str, ...]``,
  the solution plan of one task: ``expert`` plays the plan then ``finish``; ``noisy`` makes one
  malformed call before a planned action with probability ``noise_rate``, then the action
  (random draws from ``random.Random(f"noisy/{task_id}/{seed}")``: ``seed`` is the policy's own
  noise seed); ``random`` plays :func:`tool_sampler`'s calls, then ``finish``;
- the fork probe: ``fork_probe`` if given, else none, and ``check_env`` looks for a
  state-changing action among the sampler's.

Adjudicated fixtures are not derived: a label must come from a check independent of the
verifier (``closedloop.envs.sim.fixtures.played_fixture``); without ``fixtures`` the verifier
FP/FN gate says it was not measured. docs/environments.md shows a whole package in this route.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from closedloop.contracts import Action
from closedloop.contracts.package import (
    ActionSampler,
    EnvPackage,
    ForkProbe,
    Rules,
    ScriptedFactory,
    ScriptedPolicyLike,
)
from closedloop.envs.sim.catalog import SimTask, TaskCatalog
from closedloop.envs.sim.package import sim_package
from closedloop.envs.sim.scoring import Grade, SimVerifier
from closedloop.envs.sim.state import SimState
from closedloop.errors import TaskError

__all__ = ["planned_policies", "rules_package", "tool_sampler"]

SimpleGrade = Callable[[SimTask, SimState], "Grade | bool | float"]
"""Decide one task from its decoded final state: a ``Grade``, or ``task_success`` itself."""
ExpertPlan = Callable[[SimTask], Sequence[Action | str]]
"""The solution plan of one task (the actions before ``finish``)."""
_WORDS = ("", "a", "zero", "42", "-1", "x" * 40)


def _random_value(rng: random.Random, kind: Any) -> Any:
    """A random argument of a declared JSON type (sometimes of another type)."""
    if rng.random() < 0.1:
        return rng.choice([None, "?", 3.5, [], {}])
    if kind == "integer":
        return rng.randrange(-2, 12)
    if kind == "number":
        return round(rng.uniform(-2.0, 12.0), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    return rng.choice(_WORDS)


def tool_sampler(tool_schemas: Sequence[Mapping[str, Any]]) -> ActionSampler:
    """``(rng, task_id) -> Action``: a declared tool with random arguments of its declared
    types (each parameter present with probability 0.9), or an unknown tool (1 in 10)."""
    schemas = tuple(tool_schemas)

    def sample(rng: random.Random, task_id: str) -> Action | str:
        if rng.random() < 0.1:
            return Action.tool("no_such_tool", x=rng.randrange(3))
        schema = rng.choice(schemas)
        params = schema.get("parameters") or {}
        args = {name: _random_value(rng, kind) for name, kind in params.items()
                if rng.random() < 0.9}
        return Action.tool(str(schema["name"]), **args)

    return sample


class _Plan:
    """Plays a list of actions, then ``finish``."""

    def __init__(self, plan: Sequence[Action | str]) -> None:
        self.plan = list(plan)

    def act(self, observation: str) -> Action | str:
        """The next planned action (``finish`` once the plan is played)."""
        return self.plan.pop(0) if self.plan else Action.finish()


def _noisy_plan(plan: Sequence[Action | str], rate: float, rng: random.Random) -> list[Any]:
    out: list[Action | str] = []
    for step in plan:
        if rng.random() < rate:
            text = step.model_text() if isinstance(step, Action) else step
            out.append(text[: max(1, len(text) - 3)])  # the closing delimiter cut: unparsable
        out.append(step)
    return out


def planned_policies(catalog: TaskCatalog, expert: ExpertPlan,
                     sampler: ActionSampler) -> dict[str, ScriptedFactory]:
    """``expert``, ``noisy`` and ``random`` factories ``(task_id, seed, noise_rate) -> policy``
    (see the module docstring)."""

    def expert_policy(task_id: str, seed: int, rate: float) -> ScriptedPolicyLike:
        return _Plan(expert(catalog.task(task_id)))

    def noisy_policy(task_id: str, seed: int, rate: float) -> ScriptedPolicyLike:
        rng = random.Random(f"noisy/{task_id}/{seed}")
        return _Plan(_noisy_plan(expert(catalog.task(task_id)), rate, rng))

    def random_policy(task_id: str, seed: int, rate: float) -> ScriptedPolicyLike:
        rng = random.Random(f"random/{task_id}/{seed}")
        return _Plan([sampler(rng, task_id) for _ in range(rng.randrange(1, 6))])

    return {"expert": expert_policy, "noisy": noisy_policy, "random": random_policy}


def _as_grade(grade: SimpleGrade) -> Callable[[SimTask, SimState], Grade]:
    def decide(task: SimTask, state: SimState) -> Grade:
        result = grade(task, state)
        if isinstance(result, Grade):
            return result
        if not isinstance(result, bool | int | float):
            raise TaskError(f"grade of {task.task_id!r} returned {type(result).__name__}, "
                            "not a Grade, bool or float")
        success = float(result)
        return Grade(success, {}, "ok" if success >= 1.0 else "not solved")
    return decide


def rules_package(*, env_id: str, rules: Callable[[], Rules], catalog: TaskCatalog,
                  grade: SimpleGrade, tools: Sequence[Mapping[str, Any]], system_prompt: str,
                  expert: ExpertPlan | None = None, verifier_version: str | None = None,
                  public_check: Callable[[SimTask, SimState], str | None] | None = None,
                  action_sampler: ActionSampler | None = None,
                  fork_probe: ForkProbe | None = None,
                  fixtures: Callable[[tuple[str, ...] | None], Sequence[Any]] | None = None,
                  description: str = "") -> EnvPackage:
    """The ``EnvPackage`` of a rule-driven environment (see the module docstring).

    ``verifier_version`` defaults to ``f"{env_id}-verifier"``: give a new one whenever ``grade``
    changes. ``public_check(task, state)`` returns tampering evidence beyond the task, version
    and budget checks (``None``: none found).
    """
    env_version = rules().env_version
    version = verifier_version or f"{env_id}-verifier"
    check = public_check or (lambda task, state: None)
    sampler = action_sampler or tool_sampler(tools)
    return sim_package(
        env_id=env_id, rules=rules, catalog=catalog,
        make_verifier=lambda: SimVerifier(catalog, env_version, _as_grade(grade), check,
                                          version),
        tool_schemas=tuple(dict(t) for t in tools), system_prompt=system_prompt,
        action_sampler=sampler, fork_probe=fork_probe,
        scripted=planned_policies(catalog, expert, sampler) if expert is not None else {},
        fixtures=fixtures, description=description)
