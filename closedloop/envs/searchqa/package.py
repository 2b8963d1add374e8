"""SearchQA as the built-in environment package ``searchqa-v1``.

Scaffold: ``search`` and ``answer`` and a system prompt asking for the bare answer. The
``check_env`` sampler draws searches (question words, corpus words, nonsense, empty or
over-long queries), answers (random words, some over-long), stray and missing arguments and
unknown tools; the fork probe searches for the question. Scripted: ``expert`` and ``noisy``
(``closedloop.envs.searchqa.expert``). Fixtures per task: the gold answer and an equivalent
spelling (``The <answer>.``, or another accepted form) as positives; another entity's answer, a
padded answer listing the gold one among others, a hedged gold answer, and no answer as
negatives; rewritten search results (tamper).
"""

from __future__ import annotations

import random
from functools import cache
from typing import Any

from closedloop.contracts import Action
from closedloop.contracts.fixture import AdjudicatedFixture
from closedloop.contracts.package import EnvPackage
from closedloop.envs.searchqa.corpus import passages
from closedloop.envs.searchqa.expert import SearchQAExpert
from closedloop.envs.searchqa.rules import SearchQARules
from closedloop.envs.searchqa.tasks import CATALOG, TEMPLATES
from closedloop.envs.searchqa.verifier import make_verifier
from closedloop.envs.sim.catalog import SimTask
from closedloop.envs.sim.experts import expert_and_noisy
from closedloop.envs.sim.fixtures import (
    Play,
    first_tasks,
    fixtures_per_task,
    tampered_fixture,
)
from closedloop.envs.sim.package import sim_package

ENV_ID = "searchqa-v1"
SYSTEM_PROMPT = (
    "You are a research agent with a small library. Find facts with search, then give the "
    "answer with answer: the answer alone (a name, a word or a number), with no explanation "
    "and no alternatives. Each turn call exactly one tool, as "
    "<tool_call>{\"name\": \"search\", \"arguments\": {\"query\": \"...\"}}</tool_call>."
)
TOOL_SCHEMAS: tuple[dict[str, Any], ...] = (
    {"name": "search", "description": "Search the library; returns the top 3 passages.",
     "parameters": {"query": "string"}},
    {"name": "answer", "description": "Give the final answer (ends the episode).",
     "parameters": {"text": "string"}},
)


def sample_action(rng: random.Random, task_id: str) -> Action | str:
    """A random SearchQA action of the env's own (see the module docstring)."""
    question = CATALOG.task(task_id).objective.split()
    roll = rng.random()
    if roll < 0.6:
        source = rng.choice([question, rng.choice(passages()).text.split(), ["zzz", "qqq"]])
        query = " ".join(rng.sample(source, min(len(source), rng.randint(1, 4))))
        action = Action.tool("search", query=rng.choice([query, query, "", "x" * 300]))
    elif roll < 0.7:
        action = Action.tool("answer", text=rng.choice([" ".join(question[:2]), "",
                                                        "y" * 300]))
    elif roll < 0.85:
        bad_args: list[dict[str, Any]] = [{}, {"q": "x"}, {"query": 3},
                                          {"text": "a", "query": "b"}]
        action = Action.tool(rng.choice(["search", "answer"]), **rng.choice(bad_args))
    else:
        action = Action.tool(rng.choice(["lookup", "browse", "calculate"]), query="x")
    return action.canonical_text() if rng.random() < 0.4 else action


def fork_probe(task_id: str) -> Action:
    """A search for the question (always valid; changes the search log and the clock)."""
    return Action.tool("search", query=CATALOG.task(task_id).objective)


def fixtures(task_ids: tuple[str, ...] | None) -> list[AdjudicatedFixture]:
    """Adjudicated fixtures (see the module docstring); default: two tasks per template (32
    positives, 64 negatives: enough for the FP/FN gate's bounds at zero errors)."""
    def build(task: SimTask, play: Play) -> list[AdjudicatedFixture]:
        answers = task.hidden["answers"]
        searches = [Action.tool("search", query=q) for q in task.hidden["gold_queries"]]
        other = next(a for t in CATALOG.task_ids(task.split) if t != task.task_id
                     and (a := CATALOG.task(t).hidden["answers"][0]) not in answers)
        variant = answers[-1] if len(answers) > 1 else f"The {answers[0]}."

        def answered(kind: str, text: str, label: bool, why: str) -> AdjudicatedFixture:
            return play(kind, [*searches, Action.tool("answer", text=text)], label, why)

        gold = answered("gold", answers[0], True, "the gold answer")
        return [
            gold, answered("alt_correct", variant, True, "an accepted spelling"),
            answered("wrong_fix", other, False, "another entity's answer"),
            answered("near_miss", f"{other} or {answers[0]}", False,
                     "padding: the gold answer listed among candidates"),
            answered("hedged", f"maybe {answers[0]}", False, "a hedged answer"),
            play("initial", [*searches, Action.finish()], False, "finished without an answer"),
            tampered_fixture(gold, lambda w: {**w, "searches": [
                {**s, "results": [*s["results"][::-1], "p9999"]} for s in w["searches"]]},
                "the logged search results were rewritten")]

    ids = task_ids or first_tasks(CATALOG, ENV_ID, TEMPLATES, 2)
    return fixtures_per_task(SearchQARules, CATALOG, ids, build)


@cache
def searchqa_package() -> EnvPackage:
    """The ``searchqa-v1`` environment package."""
    return sim_package(
        env_id=ENV_ID, rules=SearchQARules, catalog=CATALOG, make_verifier=make_verifier,
        tool_schemas=TOOL_SCHEMAS, system_prompt=SYSTEM_PROMPT, action_sampler=sample_action,
        fork_probe=fork_probe,
        scripted=expert_and_noisy(
            lambda task_id, seed, rate: SearchQAExpert(CATALOG.task(task_id), seed, rate)),
        fixtures=fixtures,
        description="SearchQA: search a shipped corpus with BM25, answer strictly.")
