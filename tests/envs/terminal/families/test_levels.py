"""Hint levels: every template at every level is solvable, and the levels are graded.

``exact`` quotes the gold edit verbatim, ``located`` names the place but not the new text,
``symptom`` quotes neither; the levels of one index are the same breakage (paired).
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from closedloop.contracts import Action
from closedloop.envs.terminal.families import FAMILIES, HELDOUT_FAMILIES, generate_task
from closedloop.envs.terminal.families.base import (
    HINT_LEVELS,
    UnknownTaskError,
    base_template,
    leveled_name,
    shown,
    template_level,
)
from closedloop.envs.terminal.task_sets import build_task_sets, template_quotas
from closedloop.envs.terminal.verifier import check_solvable

ALL_FAMILIES = {**FAMILIES, **HELDOUT_FAMILIES}  # training and family-disjoint held-out
BASES = [(f.family_id, b) for f in ALL_FAMILIES.values() for b in f.base_templates]
LEVELED = [(f.family_id, t) for f in ALL_FAMILIES.values() for t in f.templates]
INDICES = (0, 1, 17, 404)


def _edit(actions: tuple[Action, ...]) -> Action:
    edits = [a for a in actions if a.kind == "tool" and a.name in ("replace", "write_file")]
    assert len(edits) == 1, "every gold solution makes exactly one edit"
    return edits[0]


def _quoted(edit: Action) -> tuple[str, ...]:
    """The texts the exact objective must quote: old and new of a replace, or the content."""
    if edit.name == "replace":
        return (str(edit.args["old"]), str(edit.args["new"]))
    return (str(edit.args["content"]).rstrip("\n"),)


def test_level_names_parse_and_order() -> None:
    assert HINT_LEVELS == ("exact", "located", "symptom")
    assert template_level("wrong-type.exact") == ("wrong-type", "exact")
    assert leveled_name("a-b", "located") == "a-b.located"
    assert base_template("wrong-type.symptom") == "wrong-type"
    assert base_template("copy-value") == "copy-value"  # unleveled (retain) names
    for bad in ("wrong-type", "wrong-type.", ".exact", "wrong-type.hard"):
        with pytest.raises(UnknownTaskError):
            template_level(bad)


@pytest.mark.parametrize(("family", "template"), LEVELED)
def test_every_template_at_every_level_passes_the_solvability_filter(family: str,
                                                                     template: str) -> None:
    for index in INDICES[::-1][:3]:  # the filter replays the gold: ~0.1 s a task
        bundle = generate_task(family, template, index)
        assert check_solvable(bundle) is None, bundle.spec.task_id


@pytest.mark.parametrize(("family", "base"), BASES)
def test_levels_of_one_index_are_the_same_breakage(family: str, base: str) -> None:
    fam = ALL_FAMILIES[family]
    for index in INDICES:
        bundles = [generate_task(family, leveled_name(base, lv), index) for lv in fam.levels]
        first = bundles[0]
        for b in bundles:
            assert b.spec.initial_files == first.spec.initial_files
            assert b.spec.commands == first.spec.commands
            assert b.spec.protected_paths == first.spec.protected_paths
            assert b.grader.checks == first.grader.checks
            assert b.grader.gold_actions == first.grader.gold_actions
            assert b.spec.split == first.spec.split
        assert [b.spec.hint_level for b in bundles] == list(fam.levels)
        assert len({b.spec.objective for b in bundles}) == len(bundles)
        assert len({b.spec.task_id for b in bundles}) == len(bundles)


@pytest.mark.parametrize(("family", "base"), BASES)
def test_exact_quotes_the_gold_edit_and_symptom_quotes_nothing(family: str, base: str) -> None:
    assert ALL_FAMILIES[family].levels == HINT_LEVELS
    for index in INDICES:
        objective = {lv: generate_task(family, leveled_name(base, lv), index).spec.objective
                     for lv in HINT_LEVELS}
        bundle = generate_task(family, leveled_name(base, "exact"), index)
        edit = _edit(bundle.grader.gold_actions)
        texts = _quoted(edit)
        path = str(edit.args["path"])
        assert path in objective["exact"] and path in objective["located"]
        for text in texts:
            assert f"`{shown(text)}`" in objective["exact"], (objective["exact"], text)
            if text.strip():
                assert shown(text) not in objective["symptom"], (objective["symptom"], text)
        new = texts[-1]
        if len(new) >= 3:  # located names the place and the kind of fix, not the new text
            assert shown(new) not in objective["located"], (objective["located"], new)
        for text in objective.values():
            assert "`check`" in text and "finish" in text
            assert 1 <= text.count(". ") + 1 <= 3


def test_quotas_balance_families_then_bases_then_levels() -> None:
    quotas = template_quotas(list(FAMILIES.values()), "train", 48)
    assert sum(q for *_, q in quotas) == 48
    per_family: Counter[str] = Counter()
    per_level: dict[str, Counter[str]] = {}
    for family, template, q in quotas:
        per_family[family.family_id] += q
        per_level.setdefault(family.family_id, Counter())[template_level(template)[1]] += q
    assert set(per_family.values()) == {12}
    for family in FAMILIES.values():
        levels = per_level[family.family_id]
        assert set(levels) == set(family.levels)
        assert max(levels.values()) - min(levels.values()) <= 1
    # a base's remainder goes to the levels after the previous base's (round-robin)
    (json,) = [f for f in FAMILIES.values() if f.family_id == "json-repair-v1"]
    held = json.heldout_templates
    assert len(held) == 2
    four = template_quotas([json], "heldout", 4)
    assert [(t, q) for _, t, q in four] == [
        (f"{held[0]}.exact", 1), (f"{held[0]}.located", 1), (f"{held[0]}.symptom", 0),
        (f"{held[1]}.exact", 1), (f"{held[1]}.located", 0), (f"{held[1]}.symptom", 1)]
    assert [(t, q) for _, t, q in template_quotas([json], "heldout", 3, levels=("symptom",))] == [
        (f"{held[0]}.symptom", 2), (f"{held[1]}.symptom", 1)]
    with pytest.raises(UnknownTaskError):
        template_quotas([json], "train", 3, levels=("hard",))


def test_levels_of_a_base_draw_the_same_indices() -> None:
    sets = build_task_sets(36, 12, seed=5, solvability=lambda _b: None)
    by_base: dict[tuple[str, str], dict[str, set[int]]] = {}
    for b in (*sets.train, *sets.heldout):
        base, level = template_level(b.spec.template)
        index = int(b.spec.task_id.rsplit("/", 1)[1].split("-")[0])
        by_base.setdefault((b.spec.family, base), {}).setdefault(level, set()).add(index)
    for levels in by_base.values():
        sizes = sorted(levels.values(), key=len)
        for smaller, larger in itertools.pairwise(sizes):
            assert smaller <= larger  # the first candidates are shared: paired levels


def test_split_levels_are_chosen_per_split_and_disjoint_at_the_base_level() -> None:
    leveled = [f for f in FAMILIES.values() if f.levels == HINT_LEVELS]
    sets = build_task_sets(24, 12, seed=1, solvability=lambda _b: None, families=leveled,
                           train_levels=("exact", "located"), heldout_levels=("symptom",))
    assert (len(sets.train), len(sets.heldout)) == (24, 12)
    assert {b.spec.hint_level for b in sets.heldout} == {"symptom"}
    assert Counter(b.spec.hint_level for b in sets.train) == {"exact": 12, "located": 12}
    train_bases = {(b.spec.family, base_template(b.spec.template)) for b in sets.train}
    held_bases = {(b.spec.family, base_template(b.spec.template)) for b in sets.heldout}
    assert not train_bases & held_bases
    assert all(base in FAMILIES[fam].heldout_templates for fam, base in held_bases)
    assert all(base not in FAMILIES[fam].heldout_templates for fam, base in train_bases)
