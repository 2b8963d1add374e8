"""SearchQA tasks over the shipped gazetteer: family ``searchqa-v1``.

Every question names one entity of ``world.json`` and has one answer in it; the names are
invented, so the answer has to be found by searching. Templates (index = the entity's position,
so each index space is the number of such entities):

- train, one hop: ``founded`` (year a town was founded), ``river`` (the river a town lies on),
  ``known-for`` (a town's product), ``profession`` (a person's), ``invention`` (a person's),
  ``river-length`` (a river's length in kilometres);
- held-out, two hops: ``birthplace-founded`` (year the town a person was born in was founded),
  ``source-height`` (height of the mountain a river rises on).

Public data: the question and the corpus hash. Hidden data: the accepted answers (the gold
form and its equivalent spellings, e.g. ``620`` / ``620 km`` / ``620 kilometres``), the
evidence passages and the gold search queries (the expert's plan; a test checks each query
retrieves its evidence in the top 3).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

from closedloop.envs.searchqa.corpus import corpus_hash, passages, world
from closedloop.envs.sim.catalog import SimFamily, TaskCatalog, TaskDraft
from closedloop.envs.task_records import Split
from closedloop.errors import TaskError

FAMILY_ID = "searchqa-v1"
BUDGET = 6
Question = tuple[str, list[str], list[tuple[str, str]]]  # text, answers, [(query, evidence)]


def _evidence(title: str, needle: str) -> str:
    """The id of the passage titled ``title`` whose text contains ``needle``."""
    for p in passages():
        if p.title == title and needle in p.text:
            return p.passage_id
    raise TaskError(f"searchqa corpus has no passage {title!r} containing {needle!r}")


def _town(name: str) -> Mapping[str, Any]:
    return next(t for t in world()["towns"] if t["name"] == name)


def _founded(t: Mapping[str, Any]) -> Question:
    return (f"In which year was {t['name']} founded?", [str(t["founded"])],
            [(f"{t['name']} founded", _evidence(t["name"], "founded"))])


def _river(t: Mapping[str, Any]) -> Question:
    return (f"On which river does {t['name']} lie?", [t["river"], f"river {t['river']}"],
            [(f"{t['name']} river", _evidence(t["name"], "banks"))])


def _known_for(t: Mapping[str, Any]) -> Question:
    return (f"What is {t['name']} known for?", [t["product"]],
            [(f"{t['name']} known for", _evidence(t["name"], "known for"))])


def _profession(p: Mapping[str, Any]) -> Question:
    return (f"What was the profession of {p['name']}?", [p["profession"]],
            [(f"{p['name']} profession", _evidence(p["name"], "born in"))])


def _invention(p: Mapping[str, Any]) -> Question:
    return (f"What did {p['name']} invent?", [p["invention"]],
            [(f"{p['name']} inventing", _evidence(p["name"], "inventing"))])


def _length(unit: str, short: str) -> Callable[[int], list[str]]:
    return lambda n: [str(n), f"{n} {short}", f"{n} {unit}"]


def _river_length(r: Mapping[str, Any]) -> Question:
    return (f"How long, in kilometres, is the river {r['name']}?",
            _length("kilometres", "km")(r["length"]),
            [(f"river {r['name']} long", _evidence(f"River {r['name']}", "kilometres"))])


def _birthplace_founded(p: Mapping[str, Any]) -> Question:
    town = _town(p["born"])
    return (f"In which year was the town where {p['name']} was born founded?",
            [str(town["founded"])],
            [(f"{p['name']} born", _evidence(p["name"], "born in")),
             (f"{town['name']} founded", _evidence(town["name"], "founded"))])


def _source_height(r: Mapping[str, Any]) -> Question:
    mountain = next(m for m in world()["mountains"] if m["name"] == r["source"])
    return (f"How high, in metres, is the mountain on which the river {r['name']} rises?",
            _length("metres", "m")(mountain["height"]),
            [(f"river {r['name']} rises", _evidence(f"River {r['name']}", "rises")),
             (f"{mountain['name']} high", _evidence(mountain["name"], "metres high"))])


TEMPLATES: Mapping[str, tuple[Split, str, Callable[[Mapping[str, Any]], Question]]] = {
    "founded": ("train", "towns", _founded), "river": ("train", "towns", _river),
    "known-for": ("train", "towns", _known_for),
    "profession": ("train", "people", _profession),
    "invention": ("train", "people", _invention),
    "river-length": ("train", "rivers", _river_length),
    "birthplace-founded": ("heldout", "people", _birthplace_founded),
    "source-height": ("heldout", "rivers", _source_height),
}


def _build(template: str, index: int, rng: random.Random) -> TaskDraft:
    _, kind, make = TEMPLATES[template]
    question, answers, plan = make(world()[kind][index])
    hidden = {"answers": answers, "evidence": [e for _, e in plan],
              "gold_queries": [q for q, _ in plan]}
    return TaskDraft(question, {"question": question, "corpus": corpus_hash()}, hidden, BUDGET)


def _index_space(template: str) -> int:
    return len(world()[TEMPLATES[template][1]])


FAMILY = SimFamily(FAMILY_ID, {t: s for t, (s, _, _) in TEMPLATES.items()}, _build,
                   _index_space)
CATALOG = TaskCatalog([FAMILY], per_template=8)
"""48 train tasks (6 one-hop templates) and 16 held-out tasks (2 two-hop templates)."""
