"""SearchQA (seed 004): the shipped corpus is the generator's output, BM25 retrieves every gold
query's evidence, strict matching resists padding and hedging, check_env with fork checks."""

import string

from hypothesis import given, settings
from hypothesis import strategies as st

from closedloop.contracts import Action, Termination
from closedloop.contracts.package import TaskSetRequest
from closedloop.envs.check import check_package
from closedloop.envs.discovery import resolve_package
from closedloop.envs.searchqa import is_correct, normalize
from closedloop.envs.searchqa.corpus import Bm25Retriever, corpus_bytes, passages, retriever
from closedloop.envs.searchqa.corpus_build import DATA_DIR, render
from closedloop.envs.searchqa.package import searchqa_package
from closedloop.envs.searchqa.rules import search_results
from closedloop.envs.searchqa.tasks import CATALOG, TEMPLATES
from closedloop.envs.verifier_audit import audit_verifier

PKG = searchqa_package()


def test_shipped_data_is_the_generators_output():
    files = render()
    assert sorted(files) == ["corpus.jsonl", "world.json"]
    for name, data in files.items():
        assert (DATA_DIR / name).read_bytes() == data, name
    assert corpus_bytes() == files["corpus.jsonl"]
    assert 300 <= len(passages()) <= 400


def test_every_gold_query_retrieves_its_evidence_in_the_top_three():
    checked = 0
    for family in CATALOG.families.values():
        for template in TEMPLATES:
            for i in range(family.indices(template)):
                hidden = CATALOG.generate(family.family_id, template, i).hidden
                for query, evidence in zip(hidden["gold_queries"], hidden["evidence"],
                                           strict=True):
                    assert evidence in search_results(query), (template, i, query)
                    checked += 1
    assert checked == 48 * 3 + 48 * 2 + 24 + 2 * (48 + 24)  # one-hop + two-hop queries


def test_retrieval_is_bm25_and_deterministic():
    fresh = Bm25Retriever(passages())
    for query in ("founded", "river long kilometres", "Mount high", "zzz", "the of and"):
        assert [p.passage_id for p in fresh.search(query, 5)] == \
               [p.passage_id for p in retriever().search(query, 5)]
    assert retriever().search("zzz qqq", 3) == []
    town = CATALOG.generate("searchqa-v1", "founded", 0).objective.split()[4]
    top = retriever().search(f"{town} founded", 3)[0]
    assert top.title == town and "founded" in top.text


def test_check_package_runs_the_envs_own_actions_and_fork_checks():
    sets = PKG.task_sets(TaskSetRequest(4, 2))
    report = check_package(PKG, [*sets.train, *sets.heldout], seeds=(0, 1))
    assert report.fork_checks == 12 and report.missing == ()
    assert resolve_package("searchqa-v1") is PKG


def test_the_expert_solves_every_task_and_answer_ends_the_episode():
    verifier = PKG.verifier()
    sets = PKG.task_sets(TaskSetRequest(48, 16))
    for task_id in sets.train + sets.heldout:
        env = PKG.make_env()
        obs = env.reset(task_id, 0)
        policy = PKG.scripted_policy("noisy", task_id, 0, 0.5)
        for _ in range(8):
            t = env.step(policy.act(obs))
            obs = t.observation
            if t.done:
                break
        assert t.termination is Termination.AGENT_FINISH and obs == "Answer recorded."
        result = verifier.score_or_quarantine(task_id, env.export_state())
        assert result.success == 1.0 and result.reward["evidence_found"] == 1.0, task_id


def test_bad_arguments_change_nothing():
    env = PKG.make_env()
    env.reset(CATALOG.task_ids("train")[0], 0)
    before = env.current_state().world()
    for action in (Action.tool("search", query=""), Action.tool("search", q="x"),
                   Action.tool("answer", text="x" * 201), Action.tool("lookup", query="x")):
        assert env.step(action).error in ("bad_arguments", "unknown_tool")
    assert env.current_state().world() == before


def test_matching_accepts_only_the_answer():
    accepted = ["620", "620 km", "620 kilometres"]
    for good in ("620", " 620. ", "620 KM", '"620"', "620  kilometres"):
        assert is_correct(good, accepted), good
    for bad in ("620 or 540", "540, 620", "maybe 620", "I think 620", "about 620",
                "620?? not sure", "The answer is 620", "6200", "62", "", "620 620"):
        assert not is_correct(bad, accepted), bad
    assert is_correct("The Tide Clock", ["tide clock"])
    assert not is_correct("a tide clock or a seed drill", ["tide clock"])


_WORDS = st.text(alphabet=string.ascii_letters + string.digits + " ,;:/-", min_size=1,
                 max_size=30).filter(lambda s: any(c.isalnum() for c in s))


@settings(max_examples=300, deadline=None)
@given(gold=st.sampled_from(["1412", "Ousel", "tide clock", "weaver"]), pad=_WORDS,
       before=st.booleans())
def test_padding_or_hedging_never_matches(gold, pad, before):
    text = f"{pad} {gold}" if before else f"{gold} {pad}"
    assert is_correct(text, [gold]) == (normalize(text) == normalize(gold))
    article = before and pad.strip().lower() in ("the", "a", "an")
    if any(c.isalnum() for c in pad) and not article:  # a containment match would accept these
        assert not is_correct(text, [gold]), text


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_normalize_is_idempotent(text):
    assert normalize(normalize(text)) == normalize(normalize(normalize(text)))


def test_verifier_agrees_with_every_adjudicated_fixture():
    fixtures = PKG.fixtures(None)
    assert len(fixtures) == 16 * 7
    audit = audit_verifier(fixtures, PKG.verifier())
    assert (audit.fp, audit.fn, audit.tamper_missed, audit.false_quarantine) == (0, 0, 0, 0)
    assert audit.fp_ci[1] <= 0.1 and audit.fn_ci[1] <= 0.15  # the gate's bounds
    kinds = {f.kind for f in fixtures if not f.label and not f.expect_quarantine}
    assert {"near_miss", "hedged", "wrong_fix", "initial"} <= kinds
