"""SearchQA's shipped corpus and its BM25 retriever (``bm25s``, local, no network).

``passages()`` reads ``data/corpus.jsonl`` from the package; ``world()`` reads ``data/world.json``
(the facts, for task generation and the verifier; the retriever never sees it).
``corpus_hash()`` is the sha256 of the corpus bytes: task ids include it, so a changed corpus
changes every task id.

``Bm25Retriever.search(query, k)`` ranks passages by Okapi BM25 (bm25s' Lucene variant, k1 1.5,
b 0.75) over title + text, tokenized by bm25s (lower-cased words of two or more characters,
English stopwords removed). Only passages with a positive score are returned, best first, ties
broken by passage order, so a query's results are a pure function of the query and the corpus.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import numpy as np

from closedloop.contracts import sha256_hex
from closedloop.errors import TaskError

_DATA = "closedloop.envs.searchqa"


@dataclass(frozen=True)
class Passage:
    """One corpus passage."""

    passage_id: str
    title: str
    text: str

    def render(self) -> str:
        """``[p0012] Title: text`` (how a search result is shown)."""
        return f"[{self.passage_id}] {self.title}: {self.text}"


def _read(name: str) -> bytes:
    try:
        return resources.files(_DATA).joinpath("data", name).read_bytes()
    except FileNotFoundError:
        raise TaskError(f"searchqa data file {name!r} is missing from the package") from None


@cache
def corpus_bytes() -> bytes:
    """The shipped ``corpus.jsonl``."""
    return _read("corpus.jsonl")


@cache
def corpus_hash() -> str:
    """sha256 of the corpus bytes."""
    return sha256_hex(corpus_bytes())


@cache
def passages() -> tuple[Passage, ...]:
    """The corpus passages in file order."""
    out = []
    for line in corpus_bytes().decode("utf-8").splitlines():
        obj = json.loads(line)
        out.append(Passage(obj["id"], obj["title"], obj["text"]))
    return tuple(out)


@cache
def passage_by_id() -> dict[str, Passage]:
    """Passage id -> passage."""
    return {p.passage_id: p for p in passages()}


@cache
def world() -> dict[str, Any]:
    """The shipped facts (``world.json``)."""
    value: dict[str, Any] = json.loads(_read("world.json"))
    return value


class Bm25Retriever:
    """BM25 over the corpus (see the module docstring)."""

    def __init__(self, corpus: tuple[Passage, ...]) -> None:
        import bm25s

        self._bm25s = bm25s
        self.corpus = corpus
        tokens = bm25s.tokenize([f"{p.title} {p.text}" for p in corpus], stopwords="en",
                                show_progress=False)
        self._index = bm25s.BM25()
        self._index.index(tokens, show_progress=False)

    def search(self, query: str, k: int = 3) -> list[Passage]:
        """The top ``k`` passages with a positive score, best first (ties: corpus order)."""
        words = self._bm25s.tokenize([query], stopwords="en", show_progress=False,
                                     return_ids=False)[0]
        if not words:
            return []
        scores = np.asarray(self._index.get_scores(words), dtype=np.float64)
        order = np.lexsort((np.arange(len(scores)), -scores))
        return [self.corpus[int(i)] for i in order[:k] if scores[int(i)] > 0.0]


@cache
def retriever() -> Bm25Retriever:
    """The process-wide retriever over the shipped corpus (built once)."""
    return Bm25Retriever(passages())
