"""Shopping tasks (docs/environments.md, built-in packages): family ``shopping-v1``, one template
per product category.

A task is a small catalog and a request: buy a product of one category in a given colour and
size, at most a price (the size surcharge included), rated at least so many stars. Public data
(what the environment materializes): the catalog, with canonical item numbers. Hidden data (the
verifier's only): the structured constraints. Exactly one item of the catalog can satisfy them;
every other item of the category is a decoy built to break one constraint (too expensive, rated
too low, lacking the colour, lacking the size, or over budget only through the size surcharge),
and a few items of other categories share words with the request.

Templates: ``backpack``, ``jacket``, ``boots``, ``tent`` (train); ``sleeping-bag``, ``headlamp``
(held-out: categories never trained on).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from closedloop.envs.sim.catalog import SimFamily, TaskCatalog, TaskDraft
from closedloop.envs.task_records import Split

FAMILY_ID = "shopping-v1"
COLOURS = ("red", "blue", "green", "black", "orange", "grey")
RATINGS = (3.5, 4.0, 4.5)
CATEGORIES: Mapping[str, tuple[str, tuple[str, ...]]] = {
    "backpack": ("hiking backpack", ("20L", "30L", "40L")),
    "jacket": ("rain jacket", ("S", "M", "L", "XL")),
    "boots": ("trail boots", ("40", "41", "42", "43", "44")),
    "tent": ("camping tent", ("1p", "2p", "3p")),
    "sleeping-bag": ("sleeping bag", ("regular", "long")),
    "headlamp": ("head lamp", ("200lm", "400lm")),
}
SPLITS: Mapping[str, Split] = {"backpack": "train", "jacket": "train", "boots": "train",
                             "tent": "train", "sleeping-bag": "heldout", "headlamp": "heldout"}
_BRANDS = ("Trailhead", "Northpeak", "Fjell", "Cairn", "Ridgeway", "Alder", "Summit", "Kestrel",
           "Birch", "Marmot Hollow", "Granite", "Tundra")
_MODELS = ("Ridge", "Venture", "Nomad", "Scout", "Drift", "Ember", "Atlas", "Vale", "Pioneer",
           "Comet", "Harbor", "Lumen")
DECOYS = ("price", "rating", "colour", "size", "surcharge", "rating", "price")
OTHERS = 5


def _item(category: str, title: str, price: int, rating: float,
          colours: Sequence[str], sizes: Sequence[str], extra: Mapping[str, int]) -> dict[str, Any]:
    return {"title": title, "category": category, "price": price, "rating": rating,
            "colors": list(colours), "sizes": list(sizes), "size_extra": dict(extra)}


def _title(rng: random.Random, noun: str, used: set[str]) -> str:
    while True:
        title = f"{rng.choice(_BRANDS)} {rng.choice(_MODELS)} {noun}"
        if title not in used:
            used.add(title)
            return title


def _good(rng: random.Random, category: str, want: Mapping[str, Any], used: set[str]
          ) -> dict[str, Any]:
    noun, sizes = CATEGORIES[category]
    extra = {want["size"]: 5} if rng.random() < 0.5 else {}
    price = want["max_price"] - extra.get(want["size"], 0) - rng.randrange(0, 20)
    colours = sorted({want["color"], *rng.sample(COLOURS, 2)})
    rating = min(5.0, want["min_rating"] + rng.choice((0.0, 0.3, 0.5)))
    return _item(category, _title(rng, noun, used), price, round(rating, 1), colours,
                 sizes, extra)


def _decoy(rng: random.Random, category: str, want: Mapping[str, Any], breaks: str,
           used: set[str]) -> dict[str, Any]:
    """An item of ``category`` that fails exactly the constraint ``breaks``."""
    item = _good(rng, category, want, used)
    if breaks == "price":
        item["price"] = want["max_price"] + rng.randrange(5, 40)
        item["size_extra"] = {}
    elif breaks == "rating":
        item["rating"] = round(want["min_rating"] - rng.choice((0.3, 0.5, 1.0)), 1)
    elif breaks == "colour":
        item["colors"] = sorted(rng.sample([c for c in COLOURS if c != want["color"]], 2))
    elif breaks == "size":
        item["sizes"] = [s for s in CATEGORIES[category][1] if s != want["size"]]
        item["size_extra"] = {}
    else:  # surcharge: the base price fits, the wanted size pushes it over
        item["price"] = want["max_price"] - rng.randrange(0, 5)
        item["size_extra"] = {want["size"]: 10}
    return item


def _build(template: str, index: int, rng: random.Random) -> TaskDraft:
    noun, sizes = CATEGORIES[template]
    want: dict[str, Any] = {"category": template, "color": rng.choice(COLOURS),
                            "size": rng.choice(sizes), "max_price": 5 * rng.randrange(12, 30),
                            "min_rating": rng.choice(RATINGS)}
    used: set[str] = set()
    items = [_good(rng, template, want, used)]
    items += [_decoy(rng, template, want, breaks, used) for breaks in DECOYS]
    for other in rng.sample([c for c in CATEGORIES if c != template], OTHERS):
        other_want = {**want, "category": other, "size": CATEGORIES[other][1][0]}
        items.append(_good(rng, other, other_want, used))
    rng.shuffle(items)
    catalog = [{"number": i + 1, **item} for i, item in enumerate(items)]
    article = "an" if want["color"][0] in "aeiou" else "a"
    objective = (f"Buy {article} {want['color']} {noun} in size {want['size']} for at most "
                 f"${want['max_price']} (size surcharge included), rated at least "
                 f"{want['min_rating']} stars.")
    return TaskDraft(objective, {"catalog": catalog, "request": objective}, {"want": want}, 16)


FAMILY = SimFamily(FAMILY_ID, SPLITS, _build)
CATALOG = TaskCatalog([FAMILY], per_template=8)
"""32 train tasks (4 categories) and 16 held-out tasks (2 categories)."""


def satisfies(item: Mapping[str, Any], color: str, size: str, want: Mapping[str, Any]
              ) -> tuple[bool, list[str]]:
    """Whether buying ``item`` in ``color``/``size`` meets ``want``, and the unmet constraints.

    price paid = ``item.price + item.size_extra.get(size, 0)``.
    """
    unmet = []
    if item["category"] != want["category"]:
        unmet.append("category")
    if color != want["color"] or color not in item["colors"]:
        unmet.append("color")
    if size != want["size"] or size not in item["sizes"]:
        unmet.append("size")
    if item["price"] + item["size_extra"].get(size, 0) > want["max_price"]:
        unmet.append("price")
    if item["rating"] < want["min_rating"]:
        unmet.append("rating")
    return not unmet, unmet
