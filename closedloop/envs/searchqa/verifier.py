"""The SearchQA verifier: strict matching of the exported answer against the hidden answers.

``task_success`` = 1.0 when the episode ended by ``answer`` and the answer is one accepted form
(``closedloop.envs.searchqa.matching.is_correct``: no containment, so padding and hedging fail),
else 0.0. Extra components: ``searches`` (count), ``evidence_found`` (the fraction of the
task's evidence passages that appeared in the episode's search results), ``answered`` (0/1).

Tampering (unscored): a question that is not the task's, or a logged search whose results are
not what the retriever returns for its query (the verifier re-runs every logged query).
"""

from __future__ import annotations

from closedloop.envs.searchqa.matching import is_correct
from closedloop.envs.searchqa.rules import ENV_VERSION, search_results
from closedloop.envs.searchqa.tasks import CATALOG
from closedloop.envs.sim.catalog import SimTask, TaskCatalog
from closedloop.envs.sim.scoring import Grade, SimVerifier, world_field
from closedloop.envs.sim.state import SimState
from closedloop.errors import StateDecodeError

VERIFIER_VERSION = "searchqa-verifier-v1"


def _searches(state: SimState) -> list[tuple[str, list[str]]]:
    out = []
    for entry in world_field(state.world(), "searches", list):
        if not isinstance(entry, dict) or set(entry) != {"query", "results"} or \
                not isinstance(entry["query"], str) or not isinstance(entry["results"], list):
            raise StateDecodeError("world field 'searches' entries must be {query, results}")
        out.append((entry["query"], [str(r) for r in entry["results"]]))
    return out


def grade(task: SimTask, state: SimState) -> Grade:
    """Decide one episode (see the module docstring)."""
    answer = world_field(state.world(), "answer", (str, type(None)))
    searches = _searches(state)
    seen = {pid for _, results in searches for pid in results}
    evidence = task.hidden["evidence"]
    components = {"searches": float(len(searches)), "answered": float(answer is not None),
                  "evidence_found": sum(e in seen for e in evidence) / len(evidence)}
    if answer is None or state.final_action != "answer":
        return Grade(0.0, components, "no answer given")
    ok = is_correct(answer, task.hidden["answers"])
    return Grade(float(ok), components, "ok" if ok else "answer does not match")


def public_check(task: SimTask, state: SimState) -> str | None:
    """Tampering evidence: another question, or search results the retriever does not give."""
    world = state.world()
    if world.get("question") != task.public["question"]:
        return "the world question is not the task's"
    try:
        searches = _searches(state)
    except StateDecodeError as exc:
        return str(exc)
    for query, results in searches:
        if results != search_results(query):
            return f"logged results of search {query[:40]!r} are not the retriever's"
    return None


def make_verifier(catalog: TaskCatalog = CATALOG) -> SimVerifier:
    """The ``TaskVerifier`` of ``searchqa-v1``."""
    return SimVerifier(catalog, ENV_VERSION, grade, public_check, VERIFIER_VERSION)
