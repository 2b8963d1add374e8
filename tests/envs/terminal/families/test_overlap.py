"""Overlap audit between train and held-out (exact and near-duplicate)."""

from __future__ import annotations

import dataclasses
import json

from closedloop.envs.terminal.families import FAMILIES, audit_overlap, generate_task, parse_task_id
from closedloop.envs.terminal.families.base import base_template, template_level
from closedloop.envs.terminal.families.overlap import (
    DEDUP_RULE_VERSION,
    DEFAULT_THRESHOLD,
    fingerprint_text,
    jaccard,
    shingles,
)
from closedloop.envs.terminal.task_sets import default_task_sets


def test_default_split_is_disjoint() -> None:
    sets = default_task_sets()
    report = audit_overlap(sets.train, sets.heldout)
    print(f"overlap: max similarity {report.max_similarity:.3f} (threshold {report.threshold}), "
          f"shared families {report.shared_families}")
    assert report.exact_pairs == () and report.near_pairs == ()
    assert report.shared_templates == ()
    assert report.disjoint
    assert json.loads(json.dumps(report.to_dict()))["disjoint"] is True
    assert report.max_similarity < report.threshold == 0.8
    assert (report.n_train, report.n_heldout) == (48, 16)
    assert report.dedup_rule_version == DEDUP_RULE_VERSION == "v2"
    # template-disjoint, not family-disjoint: reported, not hidden
    assert len(report.shared_families) == 4


def test_audit_catches_injected_near_duplicate_and_exact_copy() -> None:
    sets = default_task_sets()
    source = sets.train[5].spec
    renamed = {p: t.replace("1", "2") for p, t in source.initial_files.items()}
    near = dataclasses.replace(source, task_id="leak/near/000-00000000", split="heldout",
                               template="renamed", initial_files=renamed)
    exact = dataclasses.replace(source, task_id="leak/exact/000-00000000", split="heldout",
                                template="copied", objective="  " + source.objective.upper())
    heldout = [*(b.spec for b in sets.heldout), near, exact]
    report = audit_overlap(sets.train, heldout)
    same_files = {b.spec.task_id for b in sets.train  # source and its paired levels
                  if b.spec.initial_files == source.initial_files}
    assert source.task_id in same_files
    assert {(p.train_id, p.heldout_id) for p in report.exact_pairs} == {
        (t, exact.task_id) for t in same_files}
    near_ids = {(p.train_id, p.heldout_id) for p in report.near_pairs}
    assert (source.task_id, near.task_id) in near_ids
    assert all(p.similarity >= 0.8 for p in report.near_pairs)
    assert not report.disjoint


def test_shared_template_is_reported() -> None:
    source = default_task_sets().train[0].spec
    family, template, index = parse_task_id(source.task_id)
    base, _ = template_level(template)
    other = generate_task(family, f"{base}.located", index + 1).spec  # same base, another task
    report = audit_overlap([source], [other])
    assert report.shared_templates == (f"{family}/{base}",)
    assert report.exact_pairs == ()


def test_another_hint_level_of_a_train_task_is_the_same_task() -> None:
    sets = default_task_sets()
    source = next(b for b in sets.train if b.spec.hint_level == "exact").spec
    family, template, index = parse_task_id(source.task_id)
    base, _ = template_level(template)
    other = generate_task(family, f"{base}.symptom", index).spec
    assert other.objective != source.objective and other.task_id != source.task_id
    report = audit_overlap(sets.train, [*(b.spec for b in sets.heldout), other])
    same_task = {b.spec.task_id for b in sets.train
                 if b.spec.family == family and base_template(b.spec.template) == base
                 and parse_task_id(b.spec.task_id)[2] == index}  # its paired levels in train
    assert source.task_id in same_task
    assert {(p.train_id, p.heldout_id) for p in report.exact_pairs} == {
        (t, other.task_id) for t in same_task}
    assert report.shared_templates == (f"{family}/{base}",)
    assert not report.disjoint


def test_similarity_primitives() -> None:
    assert jaccard(shingles("abcdef"), shingles("abcdef")) == 1.0
    assert jaccard(shingles("abcdefgh"), shingles("zzzzzzzz")) == 0.0
    # "abcdefg" -> {abcde, bcdef, cdefg}; "abcdefx" -> {abcde, bcdef, cdefx}: 2 / 4
    assert jaccard(shingles("abcdefg"), shingles("abcdefx")) == 0.5
    spec = default_task_sets().train[0].spec
    assert "check.py" in fingerprint_text(spec)
    assert spec.objective.lower() in fingerprint_text(spec)
    assert spec.objective.lower() not in fingerprint_text(spec, objective=False)
    assert "check.py" not in fingerprint_text(spec, exclude=("check.py",))


def test_no_heldout_template_is_a_near_duplicate_of_a_train_template() -> None:
    """Over sampled draws (symptom level: the objectives most alike), every (train, held-out)
    pair of one family stays below the threshold, so the audit passes for any seed, not only
    the default sets'."""
    worst = 0.0
    for family in FAMILIES.values():
        draws = {b: [generate_task(family.family_id, f"{b}.symptom", i).spec for i in range(5)]
                 for b in family.base_templates}
        held = [t for b in family.heldout_templates for t in draws[b]]
        train = [t for b in family.base_templates if b not in family.heldout_templates
                 for t in draws[b]]
        report = audit_overlap(train, held)
        assert report.exact_pairs == () and report.near_pairs == (), family.family_id
        worst = max(worst, report.max_similarity)
    print(f"largest train/held-out similarity over sampled draws: {worst:.3f}")
    assert worst < DEFAULT_THRESHOLD
