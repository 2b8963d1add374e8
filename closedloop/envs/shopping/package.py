"""The shopping simulator as the built-in environment package ``shopping-v1``.

Scaffold: the five store tools and a system prompt. ``check_env``'s sampler draws the store's
own actions with plausible and implausible arguments (words of the request and the catalog,
existing and missing item ids, offered and unoffered options), unknown tools and missing
arguments; the fork probe is a search for the product noun. Scripted: ``expert`` and ``noisy``
(``closedloop.envs.shopping.expert``). Fixtures per task: the expert's purchase and a recovered
one (open a decoy, back, buy the right item) as positives; a decoy bought, the right item in a
wrong size, and no purchase as negatives; a purchase price rewritten in the export (tamper).
"""

from __future__ import annotations

import random
from functools import cache
from typing import Any

from closedloop.contracts import Action
from closedloop.contracts.fixture import AdjudicatedFixture
from closedloop.contracts.package import EnvPackage
from closedloop.envs.shopping.expert import ShoppingExpert
from closedloop.envs.shopping.rules import TOOLS, ShoppingRules, world_catalog
from closedloop.envs.shopping.tasks import CATALOG, CATEGORIES, satisfies
from closedloop.envs.shopping.verifier import make_verifier
from closedloop.envs.sim.catalog import SimTask
from closedloop.envs.sim.experts import expert_and_noisy
from closedloop.envs.sim.fixtures import (
    Play,
    first_tasks,
    fixtures_per_task,
    tampered_fixture,
)
from closedloop.envs.sim.package import sim_package

ENV_ID = "shopping-v1"
SYSTEM_PROMPT = (
    "You are a shopping agent in an online store. Buy exactly what the request asks for. "
    "Search, open items to see their colours and sizes, go back from items that do not fit, "
    "select a color and a size, then buy. Each turn call exactly one tool, as "
    "<tool_call>{\"name\": \"search\", \"arguments\": {\"query\": \"rain jacket\"}}</tool_call>."
    " Buying is final."
)
TOOL_SCHEMAS: tuple[dict[str, Any], ...] = (
    {"name": "search", "description": "Search the store.", "parameters": {"query": "string"}},
    {"name": "open_item", "description": "Open an item's page.",
     "parameters": {"item_id": "string"}},
    {"name": "select", "description": "Choose an option of the open item (color or size).",
     "parameters": {"option": "string", "value": "string"}},
    {"name": "back", "description": "Return to the search results.", "parameters": {}},
    {"name": "buy", "description": "Buy the open item with the selected options (final).",
     "parameters": {}},
    {"name": "abstain", "description": "Give up when nothing fits the request.",
     "parameters": {}},
)


def sample_action(rng: random.Random, task_id: str) -> Action | str:
    """A random store action of the env's own (see the module docstring)."""
    task = CATALOG.task(task_id)
    items = world_catalog(task.public, rng.randrange(3))
    item = rng.choice(items)
    name = rng.choice([*TOOLS, "search", "open_item", "select"])
    roll = rng.random()
    if roll < 0.06:
        return Action.tool(rng.choice(["checkout", "add_to_cart", "open"]), item_id=item["id"])
    if roll < 0.12:
        return Action.tool(name, **({} if TOOLS[name] else {"x": "1"}))
    if name == "search":
        words = [*task.objective.split(), *item["title"].split(), "zzz"]
        query = " ".join(rng.sample(words, rng.randint(1, 3)))
        action = Action.tool("search", query=query)
    elif name == "open_item":
        action = Action.tool("open_item", item_id=rng.choice([item["id"], "item_00", "3"]))
    elif name == "select":
        option = rng.choice(["color", "size", "colour"])
        values = [*item["colors"], *item["sizes"], "purple"]
        action = Action.tool("select", option=option, value=rng.choice(values))
    else:
        action = Action.tool(name)
    return action.canonical_text() if rng.random() < 0.4 else action


def fork_probe(task_id: str) -> Action:
    """A search for the product noun (always valid; changes the page and the clock)."""
    template = CATALOG.task(task_id).template
    return Action.tool("search", query=CATEGORIES[template][0])


def _good_and_decoy(task: SimTask) -> tuple[dict[str, Any], dict[str, Any]]:
    want = task.hidden["want"]
    items = world_catalog(task.public, 0)
    good = next(i for i in items if satisfies(i, want["color"], want["size"], want)[0])
    decoy = next(i for i in items if i["category"] == want["category"] and i is not good
                 and want["color"] in i["colors"] and want["size"] in i["sizes"])
    return good, decoy


def _buy(item: dict[str, Any], colour: str, size: str) -> list[Action]:
    return [Action.tool("open_item", item_id=item["id"]),
            Action.tool("select", option="color", value=colour),
            Action.tool("select", option="size", value=size), Action.tool("buy")]


def fixtures(task_ids: tuple[str, ...] | None) -> list[AdjudicatedFixture]:
    """Adjudicated fixtures (see the module docstring); default: three tasks per template (36
    positives, 54 negatives: enough for the FP/FN gate's bounds at zero errors)."""
    def build(task: SimTask, play: Play) -> list[AdjudicatedFixture]:
        want = task.hidden["want"]
        good, decoy = _good_and_decoy(task)
        search = Action.tool("search", query=CATEGORIES[task.template][0])
        gold = play("gold", [search, *_buy(good, want["color"], want["size"])],
                    True, "the one item meeting every constraint, as asked")
        wrong_size = next(s for s in good["sizes"] if s != want["size"])
        return [
            gold,
            play("alt_correct", [search, Action.tool("open_item", item_id=decoy["id"]),
                                 Action.tool("back"), *_buy(good, want["color"], want["size"])],
                 True, "a decoy opened, left by back, then the right item bought"),
            play("wrong_fix", [search, *_buy(decoy, want["color"], want["size"])],
                 False, "a decoy that breaks one constraint was bought"),
            play("near_miss", [search, *_buy(good, want["color"], wrong_size)],
                 False, "the right item in a size the request did not ask for"),
            play("initial", [search, Action.finish()], False, "finished without buying"),
            tampered_fixture(gold, lambda w: {**w, "purchase": {**w["purchase"], "price": 1}},
                             "the purchase price in the exported world was rewritten")]

    ids = task_ids or first_tasks(CATALOG, ENV_ID, CATEGORIES, 3)
    return fixtures_per_task(ShoppingRules, CATALOG, ids, build)


@cache
def shopping_package() -> EnvPackage:
    """The ``shopping-v1`` environment package."""
    return sim_package(
        env_id=ENV_ID, rules=ShoppingRules, catalog=CATALOG, make_verifier=make_verifier,
        tool_schemas=TOOL_SCHEMAS, system_prompt=SYSTEM_PROMPT, action_sampler=sample_action,
        fork_probe=fork_probe,
        scripted=expert_and_noisy(lambda task_id, seed, rate: ShoppingExpert(seed, rate)),
        fixtures=fixtures,
        description="Shopping simulator: search, open, select, back, buy; a "
                    "constraint-checked purchase as the hidden outcome.")
