"""Train / held-out split: balance, template disjointness and the solvability filter."""

from __future__ import annotations

import json
import random
from collections import Counter

from closedloop.contracts import Action
from closedloop.envs.terminal.families import FAMILIES, TemplateFamily
from closedloop.envs.terminal.families.base import TaskDraft, base_template
from closedloop.envs.terminal.families.json_repair import missing_key, trailing_comma
from closedloop.envs.terminal.task_sets import build_task_sets, default_task_sets, list_tasks


def test_default_sets_are_48_16_balanced_and_nothing_discarded() -> None:
    sets = default_task_sets()
    assert (len(sets.train), len(sets.heldout)) == (48, 16)
    assert sets.discarded == ()
    assert sets.shortfall == (0, 0)
    train_fams = Counter(b.spec.family for b in sets.train)
    held_fams = Counter(b.spec.family for b in sets.heldout)
    assert set(train_fams.values()) == {12} and len(train_fams) == 4
    assert set(held_fams.values()) == {4} and len(held_fams) == 4
    n_train_bases = sum(len(f.base_templates) - len(f.heldout_templates)
                        for f in FAMILIES.values())
    per_base = Counter((b.spec.family, base_template(b.spec.template)) for b in sets.train)
    assert len(per_base) == n_train_bases
    assert max(per_base.values()) - min(per_base.values()) <= 1
    for split in (sets.train, sets.heldout):  # levels balanced within each family
        for family in FAMILIES.values():
            levels = Counter(b.spec.hint_level for b in split if b.spec.family == family.family_id)
            assert set(levels) == set(family.levels)
            assert max(levels.values()) - min(levels.values()) <= 1
    assert len(set(sets.train_ids) | set(sets.heldout_ids)) == 64


def test_default_sets_are_template_disjoint_and_labelled() -> None:
    sets = default_task_sets()
    train_t = {(b.spec.family, base_template(b.spec.template)) for b in sets.train}
    held_t = {(b.spec.family, base_template(b.spec.template)) for b in sets.heldout}
    assert not train_t & held_t  # disjoint at the base level, whatever the hint level
    assert all(b.spec.split == "train" for b in sets.train)
    assert all(b.spec.split == "heldout" for b in sets.heldout)
    for family, template in held_t:
        assert template in FAMILIES[family].heldout_templates


def test_list_tasks_is_the_default_sets() -> None:
    sets = default_task_sets()
    assert list_tasks("train") == sets.train_ids
    assert list_tasks("heldout") == sets.heldout_ids
    assert list_tasks() == sets.train_ids + sets.heldout_ids


def test_sets_depend_on_seed_deterministically() -> None:
    def accept(bundle: object) -> None:
        return None

    a = build_task_sets(12, 4, seed=3, solvability=accept)
    b = build_task_sets(12, 4, seed=3, solvability=accept)
    c = build_task_sets(12, 4, seed=4, solvability=accept)
    assert a.train_ids == b.train_ids and a.heldout_ids == b.heldout_ids
    assert a.train_ids != c.train_ids
    assert (len(a.train), len(a.heldout)) == (12, 4)


def _broken_gold(rng: random.Random) -> TaskDraft:
    """A trailing-comma task whose gold 'fix' removes the wrong comma: the expert fails."""
    draft = trailing_comma(rng)
    edit = draft.gold_actions[1]
    wrong = Action.tool("replace", path=edit.args["path"], old=",\n", new="\n")
    return TaskDraft(**{**draft.__dict__, "gold_actions": (draft.gold_actions[0], wrong,
                                                           *draft.gold_actions[2:])})


def _trivial(rng: random.Random) -> TaskDraft:
    """A task whose grader already accepts the initial state."""
    draft = missing_key(rng)
    path = draft.checks["path"]
    solved = json.dumps(draft.checks["expected"], indent=2) + "\n"
    gold = (Action.tool("write_file", path=path, content=solved), Action.finish())
    return TaskDraft(**{**draft.__dict__, "gold_actions": gold,
                        "initial_files": {**draft.initial_files, path: solved}})


def test_solvability_filter_discards_broken_templates_with_reasons() -> None:
    family = TemplateFamily(
        "json-repair-v1",
        {"trailing-comma": trailing_comma, "broken-gold": _broken_gold, "trivial": _trivial},
        heldout_templates=("trivial",))
    sets = build_task_sets(4, 2, seed=0, families=[family], max_attempts_factor=2,
                           train_levels=("symptom",), heldout_levels=("exact", "symptom"))
    # the good train template fills its 2 slots; the broken one keeps none of its 4 candidates
    assert Counter(b.spec.template for b in sets.train) == {"trailing-comma.symptom": 2}
    assert sets.heldout == ()
    assert sets.shortfall == (2, 2)
    reasons = Counter((d.task_id.split("/")[1], d.reason.split(":")[0]) for d in sets.discarded)
    assert reasons == {("broken-gold.symptom", "gold replay rejected by the grader"): 4,
                       ("trivial.exact", "grader accepts the untouched initial state"): 2,
                       ("trivial.symptom", "grader accepts the untouched initial state"): 2}
    assert all(d.split == ("heldout" if "trivial" in d.task_id else "train")
               for d in sets.discarded)
