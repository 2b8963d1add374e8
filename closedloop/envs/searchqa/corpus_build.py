"""The generator of SearchQA's shipped data: a small fictional gazetteer and its passages.

``build(seed)`` is a pure function: it draws towns, people, rivers and mountains with invented
names (so a pretrained model cannot know the answers and must search), links them (a town lies
on a river and was founded by someone in a year; a person was born in a town; a river rises on a
mountain), and writes one short passage per fact, plus distractor passages that share words with
the facts. ``write(directory)`` writes ``world.json`` (the facts: the verifier's source of gold
answers) and ``corpus.jsonl`` (the passages: the only thing the retriever indexes), each in
canonical JSON. The shipped files in ``closedloop/envs/searchqa/data`` are its output for
``SEED``; a test regenerates them and compares bytes.

Run ``python -m closedloop.envs.searchqa.corpus_build`` to rewrite them.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

from closedloop.contracts import canonical_json

SEED = 2026
N_TOWNS, N_PEOPLE, N_RIVERS, N_MOUNTAINS, N_REGIONS = 48, 48, 24, 12, 8
DATA_DIR = Path(__file__).with_name("data")

_ONSETS = ("v", "m", "k", "t", "br", "dr", "s", "l", "gr", "h", "f", "th", "r", "n", "w", "c",
           "p", "z", "j", "sk")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "ia", "ou", "y")
_CODAS = ("", "n", "r", "l", "s", "th", "m", "nd", "rk", "x")
_TOWN_SUFFIXES = ("holt", "ford", "wick", "by", "mere", "stead", "ton", "ham", "dale", "gate")
_FIRST_NAMES = ("Ilsa", "Oren", "Maren", "Tobin", "Edda", "Corin", "Livia", "Anselm", "Petra",
                "Rurik", "Sabine", "Hollis", "Wren", "Idris", "Nadia", "Soren", "Greta",
                "Emeric", "Talia", "Bram")
_PROFESSIONS = ("weaver", "clockmaker", "cartographer", "glassblower", "astronomer", "brewer",
                "shipwright", "botanist", "printer", "bellfounder", "surveyor", "apothecary")
_PRODUCTS = ("glassware", "wool", "cider", "clocks", "lace", "cheese", "paper", "pottery",
             "honey", "rope", "salt", "violins")
_INVENTIONS = ("tide clock", "folding loom", "lantern lens", "seed drill", "water pump",
               "brass sextant", "paper press", "spring lock", "wind gauge", "copper kettle",
               "sail winch", "glass prism")


def _name(rng: random.Random, used: set[str], syllables: int, suffix: str = "") -> str:
    while True:
        body = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                       for _ in range(syllables))
        name = (body + suffix).capitalize()
        if name.lower() not in used and 4 <= len(name) <= 12:
            used.add(name.lower())
            return name


def build_world(seed: int = SEED) -> dict[str, Any]:
    """The facts: regions, mountains, rivers, towns and people (a pure function of ``seed``)."""
    rng = random.Random(f"searchqa-world/{seed}")
    used: set[str] = set()
    regions = [_name(rng, used, 2) for _ in range(N_REGIONS)]
    mountains = [{"name": f"Mount {_name(rng, used, 2)}", "height": rng.randrange(900, 4800)}
                 for _ in range(N_MOUNTAINS)]
    rivers = [{"name": _name(rng, used, 2), "length": rng.randrange(40, 900),
               "source": rng.choice(mountains)["name"]} for _ in range(N_RIVERS)]
    founders = [f"{rng.choice(_FIRST_NAMES)} {_name(rng, used, 2)}" for _ in range(N_TOWNS)]
    towns = [{"name": _name(rng, used, 1, rng.choice(_TOWN_SUFFIXES)),
              "region": rng.choice(regions), "river": rng.choice(rivers)["name"],
              "founded": rng.randrange(900, 1900), "founder": founders[i],
              "product": rng.choice(_PRODUCTS)} for i in range(N_TOWNS)]
    people = [{"name": f"{rng.choice(_FIRST_NAMES)} {_name(rng, used, 2)}",
               "profession": rng.choice(_PROFESSIONS), "born": rng.choice(towns)["name"],
               "invention": rng.choice(_INVENTIONS)} for _ in range(N_PEOPLE)]
    return {"seed": seed, "regions": regions, "mountains": mountains, "rivers": rivers,
            "towns": towns, "people": people}


def build_passages(world: dict[str, Any]) -> list[dict[str, str]]:
    """One passage per fact plus distractors; ids ``p0000``... in a seeded order."""
    out: list[tuple[str, str]] = []
    for t in world["towns"]:
        out += [(t["name"], f"{t['name']} is a town in the {t['region']} region, on the banks "
                            f"of the river {t['river']}."),
                (t["name"], f"{t['name']} was founded in {t['founded']} by {t['founder']}."),
                (t["name"], f"{t['name']} is known for its {t['product']}."),
                (t["name"], f"Travellers to {t['name']} often ask when the old market hall was "
                            "built; nobody in the town remembers.")]
    for p in world["people"]:
        out += [(p["name"], f"{p['name']} was a {p['profession']} born in {p['born']}."),
                (p["name"], f"{p['name']} is remembered for inventing the {p['invention']}.")]
    for r in world["rivers"]:
        out += [(f"River {r['name']}", f"The river {r['name']} is {r['length']} kilometres "
                                       f"long and rises on {r['source']}."),
                (f"River {r['name']}", f"Boats on the river {r['name']} once carried salt "
                                       "and timber to the coast.")]
    for m in world["mountains"]:
        out.append((m["name"], f"{m['name']} is {m['height']} metres high."))
    rng = random.Random(f"searchqa-order/{world['seed']}")
    rng.shuffle(out)
    return [{"id": f"p{i:04d}", "title": title, "text": text}
            for i, (title, text) in enumerate(out)]


def render(seed: int = SEED) -> dict[str, bytes]:
    """File name -> bytes of the shipped data for ``seed``."""
    world = build_world(seed)
    passages = build_passages(world)
    return {"world.json": (canonical_json(world) + "\n").encode("utf-8"),
            "corpus.jsonl": "".join(canonical_json(p) + "\n" for p in passages).encode("utf-8")}


def write(directory: Path = DATA_DIR, seed: int = SEED) -> None:
    """Write the shipped data files into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in render(seed).items():
        (directory / name).write_bytes(data)


if __name__ == "__main__":  # pragma: no cover - the maintainer's regeneration step
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else DATA_DIR)
