"""SearchQA dynamics (a ReAct environment): ``search`` the local corpus, then ``answer``.

World: the ``question``, the ``searches`` made (each ``{"query", "results"}`` with the passage
ids returned) and the ``answer`` (``None`` until given). Each action costs one unit.

- ``search(query)``: the top ``TOP_K`` BM25 passages (``closedloop.envs.searchqa.corpus``),
  shown as ``[p0012] Title: text`` lines, or ``No passages match.``;
- ``answer(text)``: records the answer and ends the episode (``agent_finish``); the observation
  says only that the answer was recorded: whether it is right is the verifier's hidden outcome.

Errors (no change): ``unknown_tool``, ``bad_arguments`` (a missing or non-string argument, an
empty query or answer, a query over ``MAX_QUERY_CHARS`` or an answer over ``MAX_ANSWER_CHARS``
characters).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from closedloop.contracts import Action, Termination
from closedloop.contracts.package import Opening, Outcome
from closedloop.envs.searchqa.corpus import Bm25Retriever, passage_by_id, retriever
from closedloop.envs.searchqa.tasks import CATALOG
from closedloop.envs.sim.catalog import TaskCatalog
from closedloop.envs.sim.env import error_outcome

ENV_VERSION = "searchqa-v1"
TOP_K = 3
MAX_QUERY_CHARS = 200
MAX_ANSWER_CHARS = 200
TOOLS: Mapping[str, str] = {"search": "query", "answer": "text"}


def search_results(query: str, index: Bm25Retriever | None = None) -> list[str]:
    """The passage ids ``search(query)`` returns (the verifier re-runs this)."""
    return [p.passage_id for p in (index or retriever()).search(query, TOP_K)]


class SearchQARules:
    """The ``Rules`` of ``searchqa-v1`` over a task catalog."""

    env_version = ENV_VERSION

    def __init__(self, catalog: TaskCatalog = CATALOG) -> None:
        self.catalog = catalog

    def opening(self, task_id: str, seed: int) -> Opening:
        """The question of ``task_id`` (the seed changes nothing)."""
        task = self.catalog.task(task_id)
        world = {"question": task.public["question"], "searches": [], "answer": None}
        text = (f"Question: {task.public['question']} Search the library with "
                "search(query); when you know the answer, give it with answer(text): the "
                f"answer alone, nothing else. You have {task.budget} actions.")
        return Opening(world, task.budget, text)

    def apply(self, world: Mapping[str, Any], action: Action) -> Outcome:
        """Apply ``search`` or ``answer`` (see the module docstring)."""
        param = TOOLS.get(action.name)
        if param is None:
            return error_outcome("unknown_tool", f"unknown tool {action.name!r}; tools: "
                                 "search, answer")
        value = action.args.get(param)
        limit = MAX_QUERY_CHARS if action.name == "search" else MAX_ANSWER_CHARS
        if set(action.args) != {param} or not isinstance(value, str) or not value.strip() \
                or len(value) > limit:
            return error_outcome("bad_arguments", f"{action.name} takes one non-empty string "
                                 f"argument {param!r} of at most {limit} characters")
        new = dict(world)
        if action.name == "answer":
            new["answer"] = value
            return Outcome("Answer recorded.", world=new, end=Termination.AGENT_FINISH,
                           final_action="answer")
        ids = search_results(value)
        new["searches"] = [*world["searches"], {"query": value, "results": ids}]
        if not ids:
            return Outcome("No passages match.", world=new)
        by_id = passage_by_id()
        return Outcome("\n".join(by_id[i].render() for i in ids), world=new)
