"""Key-and-door as the built-in environment package ``keydoor-v1``.

Scaffold: one tool schema per macro-action (no arguments) and a system prompt that explains
the phase mask and the clue. ``check_env``'s sampler draws every macro-action (masked ones
included), the same with stray arguments, and unknown names; the fork probe is ``inspect``
(available in every phase before a door is open). Scripted: ``expert`` and ``noisy``
(``closedloop.envs.keydoor.expert``). Fixtures per task: the expert's episode (positive), a
swap-then-correct episode (positive), the wrong door, finishing without a door, the right door
then ``abstain`` (negatives), and an edited clue (tamper); by default on the first three tasks
of each target colour of each template.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

from closedloop.contracts import Action
from closedloop.contracts.fixture import AdjudicatedFixture
from closedloop.contracts.package import EnvPackage
from closedloop.envs.keydoor.expert import KeyDoorExpert
from closedloop.envs.keydoor.rules import ACTIONS, KeyDoorRules
from closedloop.envs.keydoor.tasks import CATALOG
from closedloop.envs.keydoor.verifier import make_verifier
from closedloop.envs.scripted import play
from closedloop.envs.sim.catalog import SimTask
from closedloop.envs.sim.env import SimEnv
from closedloop.envs.sim.experts import expert_and_noisy
from closedloop.envs.sim.fixtures import Play, fixtures_per_task, tampered_fixture
from closedloop.envs.sim.package import sim_package

ENV_ID = "keydoor-v1"
SYSTEM_PROMPT = (
    "You are an agent in a room with a red door and a blue door and a key of each colour. "
    "Only one door is the exit; its colour is revealed only by inspecting the room, so "
    "remember what you saw. Each turn, call exactly one of the available actions listed in "
    "the observation, as <tool_call>{\"name\": \"inspect\"}</tool_call>. Open the exit door "
    "with the key of its colour, then finish. Actions take time; do not waste the budget."
)
_DESCRIPTIONS = {
    "inspect": "Look around the room (shows the clue).", "pickup_red": "Pick up the red key.",
    "pickup_blue": "Pick up the blue key.", "open_red": "Open the red door (needs the red key).",
    "open_blue": "Open the blue door (needs the blue key).",
    "finish": "End the episode.",
}
TOOL_SCHEMAS: tuple[dict[str, Any], ...] = tuple(
    {"name": name, "description": _DESCRIPTIONS[name], "parameters": {}} for name in ACTIONS)


def sample_action(rng: random.Random, task_id: str) -> Action | str:
    """A random macro-action of the env's own: valid, masked, with stray args, or unknown."""
    roll = rng.random()
    name = rng.choice(ACTIONS[:-1])
    if roll < 0.75:
        return Action.tool(name) if rng.random() < 0.5 else Action.tool(name).canonical_text()
    if roll < 0.85:
        return Action.tool(name, colour=rng.choice(["red", "blue", 3]))
    if roll < 0.93:
        return Action.tool(rng.choice(["open_green", "pickup", "unlock", "look"]))
    return Action.finish() if rng.random() < 0.7 else Action.abstain()


def fork_probe(task_id: str) -> Action:
    """``inspect``: changes the world (``inspected``) and the clock in every phase it is in."""
    return Action.tool("inspect")


def _expert_actions(task_id: str) -> list[str]:
    policy = KeyDoorExpert()
    episode = play(SimEnv(KeyDoorRules()), _Adapter(policy), task_id)
    return list(episode.texts)


class _Adapter:
    """``closedloop.envs.scripted.play`` passes history; the expert reads observations only."""

    def __init__(self, policy: KeyDoorExpert) -> None:
        self.policy = policy

    def act(self, observation: str, history: Sequence[Any] | None = None) -> Action | str:
        return self.policy.act(observation)


FIXTURES_PER_COLOUR = 3


def default_fixture_tasks() -> tuple[str, ...]:
    """For each template, its first ``FIXTURES_PER_COLOUR`` tasks of each target colour (18
    tasks: 36 positives and 54 negatives, enough for the FP/FN gate's bounds at zero errors)."""
    out: list[str] = []
    for template in ("standard", "tight", "prekeyed"):
        tasks = [CATALOG.generate("keydoor-v1", template, i) for i in range(100)]
        for colour in ("red", "blue"):
            out += [t.task_id for t in tasks if t.hidden["target"] == colour][
                :FIXTURES_PER_COLOUR]
    return tuple(out)


def fixtures(task_ids: tuple[str, ...] | None) -> list[AdjudicatedFixture]:
    """Adjudicated fixtures (see the module docstring); default: one task per template."""
    def build(task: SimTask, play: Play) -> list[AdjudicatedFixture]:
        target = task.hidden["target"]
        other = "blue" if target == "red" else "red"
        gold = play("gold", _expert_actions(task.task_id), True,
                    "the expert inspects, takes the clue's key, opens its door")
        return [
            gold,
            play("alt_correct", [Action.tool(f"pickup_{other}"), Action.tool(f"pickup_{target}"),
                                 Action.tool(f"open_{target}"), Action.finish()],
                 True, "a guessed wrong key swapped for the right one before any door"),
            play("wrong_fix", [Action.tool(f"pickup_{other}"), Action.tool(f"open_{other}"),
                               Action.finish()], False, "the non-exit door was opened"),
            play("initial", [Action.finish()], False, "finished without opening a door"),
            play("near_miss", [Action.tool(f"pickup_{target}"), Action.tool(f"open_{target}"),
                               Action.abstain()],
                 False, "the exit was opened but the episode ended by abstain, not finish"),
            tampered_fixture(gold, _rewrite_clue(f"The {other} door."),
                             "the clue in the exported world was rewritten")]

    return fixtures_per_task(KeyDoorRules, CATALOG, task_ids or default_fixture_tasks(), build)


def _rewrite_clue(clue: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda world: {**world, "clue": clue}


@cache
def keydoor_package() -> EnvPackage:
    """The ``keydoor-v1`` environment package."""
    return sim_package(
        env_id=ENV_ID, rules=KeyDoorRules, catalog=CATALOG, make_verifier=make_verifier,
        tool_schemas=TOOL_SCHEMAS, system_prompt=SYSTEM_PROMPT, action_sampler=sample_action,
        fork_probe=fork_probe,
        scripted=expert_and_noisy(lambda task_id, seed, rate: KeyDoorExpert(seed, rate)),
        fixtures=fixtures,
        description="Key-and-door: a hidden exit colour, macro-actions, phase masks.")
