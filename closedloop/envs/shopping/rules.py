"""Shopping-simulator dynamics: search, open an item, select options, go back, buy.

World: ``catalog`` (the task's items, each with a display ``id`` ``item_NN`` assigned by a
permutation drawn from the seed, so ids carry nothing across seeds), ``page`` (``None``, the
string ``results``, or the open item's id), ``results`` (ids of the last search), ``selected``
(``{"color": ..., "size": ...}`` chosen on the open item) and ``purchase`` (``None`` until
``buy``). Each action costs one time unit.

- ``search(query)``: items whose title or category share a word with the query (lower-cased
  words of two or more letters), best first (shared words, then id), at most ``MAX_RESULTS``,
  listed with price and rating; colours and sizes show only on the item page.
- ``open_item(item_id)``: the item page (price, rating, colours, sizes with surcharges); the
  selection starts empty.
- ``select(option, value)``: ``option`` is ``color`` or ``size``, ``value`` one the open item
  offers.
- ``back()``: the last results again (a wrong item is recoverable until ``buy``).
- ``buy()``: needs an open item with colour and size selected; records the purchase (the price
  paid includes the surcharge) and ends the episode (``agent_finish``). The observation confirms
  the order and never says whether it meets the request: that is the verifier's hidden outcome.

Errors (no change): ``unknown_tool``, ``bad_arguments``, ``not_found`` (no such item),
``no_item_open``, ``no_results`` (``back`` before any search), ``options_missing``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any

from closedloop.contracts import Action, Termination
from closedloop.contracts.package import Opening, Outcome
from closedloop.envs.shopping.tasks import CATALOG
from closedloop.envs.sim.catalog import TaskCatalog
from closedloop.envs.sim.env import error_outcome

ENV_VERSION = "shopping-v1"
MAX_RESULTS = 8
TOOLS: Mapping[str, tuple[str, ...]] = {"search": ("query",), "open_item": ("item_id",),
                                        "select": ("option", "value"), "back": (), "buy": ()}
_WORD_RE = re.compile(r"[a-z0-9]{2,}")


def words(text: str) -> set[str]:
    """The lower-cased words of two or more letters/digits in ``text``."""
    return set(_WORD_RE.findall(text.lower()))


def world_catalog(public: Mapping[str, Any], seed: int) -> list[dict[str, Any]]:
    """The task's catalog with the display ids the seed assigns (a pure function)."""
    items = [dict(item) for item in public["catalog"]]
    ids = random.Random(f"shopping-ids/{seed}").sample(range(10, 100), len(items))
    for item, n in zip(items, ids, strict=True):
        item["id"] = f"item_{n:02d}"
    return items


def price_of(item: Mapping[str, Any], size: str | None) -> int:
    """Price paid for ``item`` in ``size`` (the surcharge included)."""
    extra: int = item["size_extra"].get(size, 0) if size is not None else 0
    return int(item["price"]) + extra


def _line(item: Mapping[str, Any]) -> str:
    return f"{item['id']} {item['title']} ${item['price']} ({item['rating']} stars)"


def _page(item: Mapping[str, Any]) -> str:
    sizes = ", ".join(s + (f" (+${item['size_extra'][s]})" if s in item["size_extra"] else "")
                      for s in item["sizes"])
    return (f"{item['id']}: {item['title']}. Price ${item['price']}. Rating {item['rating']} "
            f"stars. Colours: {', '.join(item['colors'])}. Sizes: {sizes}. Select a color and "
            "a size, then buy; or go back.")


class ShoppingRules:
    """The ``Rules`` of ``shopping-v1`` over a task catalog."""

    env_version = ENV_VERSION

    def __init__(self, catalog: TaskCatalog = CATALOG) -> None:
        self.catalog = catalog

    def opening(self, task_id: str, seed: int) -> Opening:
        """The store for ``task_id``; the seed assigns the item ids."""
        task = self.catalog.task(task_id)
        world: dict[str, Any] = {"catalog": world_catalog(task.public, seed), "page": None,
                                 "results": [], "selected": {}, "purchase": None}
        text = (f"You are shopping in an online store. Request: {task.objective} Tools: "
                "search(query), open_item(item_id), select(option, value) with option color "
                f"or size, back(), buy(). You have {task.budget} actions.")
        return Opening(world, task.budget, text)

    def apply(self, world: Mapping[str, Any], action: Action) -> Outcome:
        """Apply one store action (see the module docstring)."""
        params = TOOLS.get(action.name)
        if params is None:
            return error_outcome("unknown_tool", f"unknown tool {action.name!r}; tools: "
                                 f"{', '.join(TOOLS)}")
        if set(action.args) != set(params) or not all(isinstance(action.args[p], str)
                                                       for p in params):
            return error_outcome("bad_arguments", f"{action.name} takes string arguments "
                                 f"{list(params)}")
        handler = getattr(self, f"_{action.name}")
        outcome: Outcome = handler(dict(world), *(action.args[p] for p in params))
        return outcome

    def _search(self, world: dict[str, Any], query: str) -> Outcome:
        wanted = words(query)
        scored = [(len(wanted & words(f"{it['title']} {it['category']}")), it["id"], it)
                  for it in world["catalog"]]
        hits = sorted((s for s in scored if s[0] > 0), key=lambda s: (-s[0], s[1]))
        items = [it for _, _, it in hits[:MAX_RESULTS]]
        world.update(page="results", results=[it["id"] for it in items], selected={})
        if not items:
            return Outcome(f"No results for {query!r}.", world=world)
        listing = "; ".join(_line(it) for it in items)
        return Outcome(f"Results for {query!r}: {listing}.", world=world)

    def _open_item(self, world: dict[str, Any], item_id: str) -> Outcome:
        item = _find(world, item_id)
        if item is None:
            return error_outcome("not_found", f"no item {item_id!r}")
        world.update(page=item["id"], selected={})
        return Outcome(_page(item), world=world)

    def _select(self, world: dict[str, Any], option: str, value: str) -> Outcome:
        item = _find(world, world["page"])
        if item is None:
            return error_outcome("no_item_open", "open an item before selecting options")
        offered = {"color": item["colors"], "size": item["sizes"]}.get(option)
        if offered is None:
            return error_outcome("bad_arguments", "option must be 'color' or 'size'")
        if value not in offered:
            return error_outcome("bad_arguments", f"{option} {value!r} is not offered; "
                                 f"offered: {', '.join(offered)}")
        world["selected"] = {**world["selected"], option: value}
        price = price_of(item, world["selected"].get("size"))
        return Outcome(f"Selected {option} {value}. Price ${price}.", world=world)

    def _back(self, world: dict[str, Any]) -> Outcome:
        if not world["results"]:
            return error_outcome("no_results", "there are no search results to go back to")
        items = [_find(world, i) for i in world["results"]]
        world.update(page="results", selected={})
        listing = "; ".join(_line(it) for it in items if it is not None)
        return Outcome(f"Back to the results: {listing}.", world=world)

    def _buy(self, world: dict[str, Any]) -> Outcome:
        item = _find(world, world["page"])
        if item is None:
            return error_outcome("no_item_open", "open an item before buying")
        missing = [o for o in ("color", "size") if o not in world["selected"]]
        if missing:
            return error_outcome("options_missing", f"select {' and '.join(missing)} first")
        color, size = world["selected"]["color"], world["selected"]["size"]
        price = price_of(item, size)
        world["purchase"] = {"item": item["id"], "color": color, "size": size, "price": price}
        return Outcome(f"Order placed: {item['id']} ({color}, {size}) for ${price}.",
                       world=world, end=Termination.AGENT_FINISH, final_action="buy")


def _find(world: Mapping[str, Any], item_id: Any) -> dict[str, Any] | None:
    for item in world["catalog"]:
        if item["id"] == item_id:
            found: dict[str, Any] = item
            return found
    return None
