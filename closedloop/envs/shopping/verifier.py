"""The shopping verifier: checks the purchase in the exported state against the hidden request.

``task_success`` = 1.0 when the episode ended by ``buy`` and the purchased item, bought in the
selected colour and size, meets every constraint of the hidden request (category, colour, size,
price paid with the surcharge at most the limit, rating at least the minimum), judged on the
verifier's own regeneration of the catalog, never on the state's copy. Extra components:
``constraints_met`` (0..5; 0 without a purchase), ``purchased`` (0/1).

Tampering (unscored): a world catalog that is not the task's catalog under the state's seed, a
purchase of an item that does not exist, or a recorded price that is not the item's price.
"""

from __future__ import annotations

from typing import Any

from closedloop.envs.shopping.rules import ENV_VERSION, price_of, world_catalog
from closedloop.envs.shopping.tasks import CATALOG, satisfies
from closedloop.envs.sim.catalog import SimTask, TaskCatalog
from closedloop.envs.sim.scoring import Grade, SimVerifier, world_field
from closedloop.envs.sim.state import SimState
from closedloop.errors import StateDecodeError

VERIFIER_VERSION = "shopping-verifier-v1"
N_CONSTRAINTS = 5


def _purchase(task: SimTask, state: SimState) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(purchase record, the verifier's own item) or None; ``StateDecodeError`` if malformed."""
    purchase = world_field(state.world(), "purchase", (dict, type(None)))
    if purchase is None:
        return None
    if set(purchase) != {"item", "color", "size", "price"}:
        raise StateDecodeError("world field 'purchase' has the wrong keys")
    own = {item["id"]: item for item in world_catalog(task.public, state.seed)}
    item = own.get(purchase["item"])
    if item is None:
        raise StateDecodeError(f"purchase of unknown item {purchase['item']!r}")
    return purchase, item


def grade(task: SimTask, state: SimState) -> Grade:
    """Decide one episode (see the module docstring)."""
    bought = _purchase(task, state)
    if bought is None or state.final_action != "buy":
        return Grade(0.0, {"constraints_met": 0.0, "purchased": 0.0}, "nothing was bought")
    purchase, item = bought
    ok, unmet = satisfies(item, purchase["color"], purchase["size"], task.hidden["want"])
    reason = "ok" if ok else f"unmet: {', '.join(unmet)}"
    return Grade(float(ok), {"constraints_met": float(N_CONSTRAINTS - len(unmet)),
                             "purchased": 1.0}, reason)


def public_check(task: SimTask, state: SimState) -> str | None:
    """Tampering evidence: a catalog or a purchase price no action can produce."""
    world = state.world()
    if world.get("catalog") != world_catalog(task.public, state.seed):
        return "the world catalog is not the task's catalog"
    try:
        bought = _purchase(task, state)
    except StateDecodeError as exc:
        return str(exc)
    if bought is not None:
        purchase, item = bought
        if purchase["price"] != price_of(item, purchase["size"]):
            return f"purchase price {purchase['price']!r} is not the item's price"
    return None


def make_verifier(catalog: TaskCatalog = CATALOG) -> SimVerifier:
    """The ``TaskVerifier`` of ``shopping-v1``."""
    return SimVerifier(catalog, ENV_VERSION, grade, public_check, VERIFIER_VERSION)
