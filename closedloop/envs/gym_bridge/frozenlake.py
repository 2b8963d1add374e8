"""Gymnasium's FrozenLake through ``GymRules``: the example package ``frozenlake-v1``.

Tasks (family ``frozenlake-v1``): a map from Gymnasium's ``generate_random_map(size, 0.8,
seed=index)`` on non-slippery ice (so the expert always solves); templates ``4x4`` and ``6x6``
(train) and ``5x5`` (held-out). The observation is the map with the agent at ``@``. Budget:
``4 * size * size`` moves. ``lake_task`` builds a ``GymTask`` for any map, slippery ones
included (a slip is drawn from the env's RNG, which the ``TOY_TEXT_CODEC`` snapshot captures).
Public data: the map and the slipperiness; hidden: the success
return (1.0, FrozenLake's reward for reaching the goal).

Verifier: ``task_success`` = 1.0 when the env terminated with return >= the success return
(the agent stands on ``G``). A return that disagrees with the agent's cell is tampering.
Expert: value iteration on the env's own transition model (``env.P``), acting greedily from the
agent's position read off the observation.
"""

from __future__ import annotations

import random
from functools import cache
from typing import Any

from closedloop.contracts import Action
from closedloop.contracts.package import EnvPackage
from closedloop.envs.gym_bridge.from_gym import GymRules, GymTask
from closedloop.envs.sim.catalog import SimFamily, SimTask, TaskCatalog, TaskDraft
from closedloop.envs.sim.env import SimEnv
from closedloop.envs.sim.package import sim_package
from closedloop.envs.sim.scoring import Grade, SimVerifier, world_field
from closedloop.envs.sim.state import SimState

ENV_ID = "frozenlake-v1"
ACTIONS = ("left", "down", "right", "up")
VERIFIER_VERSION = "frozenlake-verifier-v1"
TEMPLATES = {"4x4": 4, "6x6": 6, "5x5": 5}


def _build(template: str, index: int, rng: random.Random) -> TaskDraft:
    from gymnasium.envs.toy_text.frozen_lake import generate_random_map

    size = TEMPLATES[template]
    desc = generate_random_map(size, 0.8, seed=index)
    return TaskDraft(OBJECTIVE, {"desc": desc, "slippery": False}, {"success_return": 1.0},
                     4 * size * size)


OBJECTIVE = "Walk across the frozen lake from S to the goal G without falling into a hole H."
CATALOG = TaskCatalog([SimFamily(ENV_ID, {"4x4": "train", "6x6": "train", "5x5": "heldout"},
                                 _build)], per_template=8)


def lake_task(desc: list[str], slippery: bool, budget: int, seed_offset: int = 0) -> GymTask:
    """A ``GymTask`` of FrozenLake on ``desc``."""
    return GymTask({"desc": list(desc), "is_slippery": slippery}, seed_offset, budget, OBJECTIVE)


def make_lake(**kwargs: Any) -> Any:
    """A bare ``FrozenLakeEnv`` (no wrappers: the budget is the task's)."""
    from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv

    return FrozenLakeEnv(**kwargs)


def _gym_task(task_id: str) -> GymTask:
    task = CATALOG.task(task_id)
    return lake_task(task.public["desc"], task.public["slippery"], task.budget)


def render_map(env: Any, obs: Any) -> str:
    """The map, one row a line, with the agent's cell shown as ``@``."""
    rows = [[c.decode() for c in row] for row in env.desc]
    row, col = divmod(int(env.s), len(rows[0]))
    rows[row][col] = "@"
    return "\n".join("".join(r) for r in rows)


def rules() -> GymRules:
    """The ``Rules`` of ``frozenlake-v1``."""
    return GymRules(ENV_ID, make_lake, _gym_task, ACTIONS, render_text=render_map)


def grade(task: SimTask, state: SimState) -> Grade:
    """Success: terminated with at least the success return."""
    world = state.world()
    total = float(world_field(world, "return", (int, float)))
    done = world_field(world, "terminated", bool)
    ok = done and total >= task.hidden["success_return"]
    return Grade(float(ok), {"return": total},
                 "ok" if ok else "fell into a hole" if done else "did not reach the goal")


def public_check(task: SimTask, state: SimState) -> str | None:
    """Tampering evidence: another task, or a return the agent's cell cannot have."""
    world = state.world()
    if world.get("task_id") != task.task_id:
        return "the world is for another task"
    desc = task.public["desc"]
    cell = world.get("gym", {}).get("s") if isinstance(world.get("gym"), dict) else None
    if not isinstance(cell, int) or not 0 <= cell < len(desc) * len(desc[0]):
        return "the agent's cell is not on the map"
    on_goal = desc[cell // len(desc[0])][cell % len(desc[0])] == "G"
    if (float(world.get("return", 0.0)) > 0) != on_goal:
        return "the return does not match the agent's cell"
    return None


def make_verifier() -> SimVerifier:
    """The ``TaskVerifier`` of ``frozenlake-v1``."""
    return SimVerifier(CATALOG, ENV_ID, grade, public_check, VERIFIER_VERSION)


class FrozenLakeExpert:
    """Greedy on value iteration over the env's transition model (``env.P``), discount 0.95."""

    def __init__(self, task_id: str) -> None:
        env = make_lake(**dict(_gym_task(task_id).kwargs))
        self.ncol = len(env.desc[0])
        values = [0.0] * env.observation_space.n
        for _ in range(200):
            values = [max(self._q(env.P[s][a], values) for a in range(4))
                      for s in range(len(values))]
        self.policy = [max(range(4), key=lambda a: self._q(env.P[s][a], values))
                       for s in range(len(values))]

    @staticmethod
    def _q(outcomes: list[tuple[float, int, float, bool]], values: list[float]) -> float:
        return sum(p * (r + (0.0 if done else 0.95 * values[s2])) for p, s2, r, done in outcomes)

    def act(self, observation: str) -> Action:
        """The greedy move from the ``@`` cell of the observed map."""
        rows = [line for line in observation.splitlines() if set(line) <= set("SFHG@")
                and line]
        cell = next((r * self.ncol + row.index("@")) for r, row in enumerate(rows[-self.ncol:])
                    if "@" in row)
        return Action.tool(ACTIONS[self.policy[cell]])


def sample_action(rng: random.Random, task_id: str) -> Action | str:
    """A random move, a move with arguments, or an unknown move."""
    roll = rng.random()
    if roll < 0.85:
        action = Action.tool(rng.choice(ACTIONS))
        return action.canonical_text() if rng.random() < 0.3 else action
    if roll < 0.93:
        return Action.tool(rng.choice(ACTIONS), steps=2)
    return Action.tool(rng.choice(["jump", "swim", "north"]))


def fork_probe(task_id: str) -> Action:
    """``right``: S is in the top-left corner, so at reset it always moves (or slides)."""
    return Action.tool("right")


def fixtures(task_ids: tuple[str, ...] | None) -> list[Any]:
    """Per task: the expert's walk and a walk that first bumps into the west wall (positives);
    a finish at the start, a walk into a hole where one lies on a straight path, and moves
    against the wall until the budget runs out (negatives); a return rewritten without reaching
    the goal (tamper). Default: six tasks per template (36 positives, >= 36 negatives)."""
    from closedloop.envs.scripted import play
    from closedloop.envs.sim.fixtures import played_fixture, tampered_fixture

    ids = task_ids or tuple(CATALOG.generate(ENV_ID, t, i).task_id for t in TEMPLATES
                            for i in range(6))
    make = lambda: SimEnv(rules())  # noqa: E731
    out = []
    for task_id in ids:
        task = CATALOG.task(task_id)
        walk = play(make(), _Adapter(FrozenLakeExpert(task_id)), task_id).texts
        bump = play(make(), _Adapter(FrozenLakeExpert(task_id), first=Action.tool("left")),
                    task_id).texts
        gold = played_fixture(make, task, "gold", walk, True, "value iteration's walk to G")
        out += [gold, played_fixture(make, task, "alt_correct", bump, True,
                                     "a bump into the west wall, then the walk to G"),
                played_fixture(make, task, "initial", [Action.finish()], False,
                               "finished at the start"),
                played_fixture(make, task, "near_miss", [Action.tool("left")] * task.budget,
                               False, "stood against the wall until the budget ran out")]
        hole = _walk_to_hole(task)
        if hole is not None:
            out.append(played_fixture(make, task, "wrong_fix", hole, False,
                                      "walked into a hole"))
        out.append(tampered_fixture(
            played_fixture(make, task, "base", [Action.finish()], False, ""),
            lambda w: {**w, "return": 1.0, "terminated": True},
            "a return of 1.0 written into a state still at the start"))
    return out


def _walk_to_hole(task: SimTask) -> list[Action] | None:
    """Moves along row 0 then down column by column until a hole, if one is reachable so."""
    desc = task.public["desc"]
    for col in range(len(desc[0])):
        for row in range(len(desc)):
            if desc[row][col] == "H":
                path = [Action.tool("right")] * col + [Action.tool("down")] * row
                cells = [desc[0][c] for c in range(1, col + 1)] + \
                        [desc[r][col] for r in range(1, row + 1)]
                if "H" not in cells[:-1] and "G" not in cells:
                    return path
    return None


class _Adapter:
    """``play`` passes history; the expert reads observations (optionally one move first)."""

    def __init__(self, policy: FrozenLakeExpert, first: Action | None = None) -> None:
        self.policy = policy
        self.first = first

    def act(self, observation: str, history: Any = None) -> Action:
        if self.first is not None:
            first, self.first = self.first, None
            return first
        return self.policy.act(observation)


@cache
def frozenlake_package() -> EnvPackage:
    """The ``frozenlake-v1`` environment package (Gymnasium's FrozenLake as an AgentEnv)."""
    return sim_package(
        env_id=ENV_ID, rules=rules, catalog=CATALOG, make_verifier=make_verifier,
        tool_schemas=tuple({"name": a, "description": f"Move {a}.", "parameters": {}}
                           for a in ACTIONS),
        system_prompt="You walk on a frozen lake shown as a map: S start, F ice, H hole, G "
                      "goal, @ you. Each turn call one move, as <tool_call>{\"name\": "
                      "\"right\"}</tool_call>.",
        action_sampler=sample_action, fork_probe=fork_probe,
        scripted={"expert": lambda task_id, seed, rate: FrozenLakeExpert(task_id)},
        fixtures=fixtures, description="Gymnasium FrozenLake through the Gymnasium adapter.")
