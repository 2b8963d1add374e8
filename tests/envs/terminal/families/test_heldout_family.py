"""The family-disjoint held-out suite: ``env-repair-v1`` and its strict ``env_equal`` grader."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from closedloop.envs.terminal.families import (
    FAMILIES,
    HELDOUT_FAMILIES,
    audit_overlap,
    generate_task,
    get_bundle,
    get_family,
)
from closedloop.envs.terminal.families.base import HINT_LEVELS, template_level
from closedloop.envs.terminal.graders import grade, parse_env_strict
from closedloop.envs.terminal.task_sets import (
    build_family_disjoint_set,
    build_task_sets,
    default_task_sets,
    list_tasks,
)
from closedloop.envs.terminal.verifier import replay_actions
from closedloop.envs.terminal.workspace import decode_state

ENV = HELDOUT_FAMILIES["env-repair-v1"]


def test_heldout_family_is_registered_apart_from_training() -> None:
    assert set(HELDOUT_FAMILIES) == {"env-repair-v1"}
    assert not set(HELDOUT_FAMILIES) & set(FAMILIES)
    assert get_family("env-repair-v1") is ENV
    assert len(ENV.base_templates) >= 6 and ENV.levels == HINT_LEVELS
    assert set(ENV.heldout_templates) == set(ENV.base_templates)  # nothing of it trains
    bundle = generate_task("env-repair-v1", "quoted-value.located", 3)
    assert get_bundle(bundle.spec.task_id) is bundle
    assert bundle.spec.split == "heldout" and bundle.spec.hint_level == "located"


@pytest.mark.parametrize(("train", "heldout", "seed"), [(48, 16, 0), (24, 8, 9)])
def test_family_disjoint_family_never_enters_the_task_sets(train: int, heldout: int,
                                                           seed: int) -> None:
    sets = build_task_sets(train, heldout, seed, solvability=lambda _b: None)
    families = {b.spec.family for b in (*sets.train, *sets.heldout)}
    assert families == set(FAMILIES)
    assert not families & set(HELDOUT_FAMILIES)
    assert not any(t.startswith("env-repair-v1/") for t in list_tasks())


def test_family_disjoint_set_is_balanced_solvable_and_deterministic() -> None:
    suite = build_family_disjoint_set(36, seed=0)
    assert len(suite) == 36
    assert {b.spec.family for b in suite} == {"env-repair-v1"}
    assert all(b.spec.split == "heldout" for b in suite)
    assert set(Counter(b.spec.template for b in suite).values()) == {2}  # 6 bases x 3 levels
    assert [b.spec.task_id for b in build_family_disjoint_set(36, seed=0)] == [
        b.spec.task_id for b in suite]
    assert [b.spec.task_id for b in build_family_disjoint_set(36, seed=1)] != [
        b.spec.task_id for b in suite]
    symptom = build_family_disjoint_set(12, seed=0, levels=("symptom",),
                                        solvability=lambda _b: None)
    assert {template_level(b.spec.template)[1] for b in symptom} == {"symptom"}
    assert Counter(template_level(b.spec.template)[0] for b in symptom) == {
        b: 2 for b in ENV.base_templates}
    # the default sets and the family-disjoint suite share no family, template or file set
    report = audit_overlap(default_task_sets().train, suite)
    assert report.disjoint and report.shared_families == ()


def test_family_disjoint_set_keeps_only_what_the_filter_accepts() -> None:
    def reject_quoted(bundle: object) -> str | None:
        return "no" if "quoted-value" in bundle.spec.template else None  # type: ignore[attr-defined]

    suite = build_family_disjoint_set(18, seed=0, solvability=reject_quoted)
    assert len(suite) == 15 and not any("quoted-value" in b.spec.template for b in suite)


@pytest.mark.parametrize("template", ENV.base_templates)
def test_env_grader_accepts_the_gold_and_rejects_the_untouched_state(template: str) -> None:
    for index in range(3):
        bundle = generate_task("env-repair-v1", f"{template}.symptom", index)
        checks, initial = bundle.grader.checks, bundle.spec.initial_files
        assert checks["kind"] == "env_equal"
        gold = decode_state(replay_actions(bundle, bundle.grader.gold_actions)).files
        assert grade(checks, gold).passed
        untouched = grade(checks, initial)
        assert not untouched.passed and untouched.reason
        # the visible check.py does not read values: a wrong value is the grader's to catch
        path = checks["path"]
        key, value = next(iter(checks["expected"].items()))
        wrong = gold[path].replace(f"{key}={value}\n", f"{key}={value}0\n")
        assert not grade(checks, {**gold, path: wrong}).passed


_KEYS = st.from_regex(r"[A-Z][A-Z0-9_]{0,8}", fullmatch=True)
_VALUES = st.from_regex(r"[a-z0-9./:-]{0,12}", fullmatch=True)


@settings(max_examples=60, deadline=None)
@given(env=st.dictionaries(_KEYS, _VALUES, min_size=1, max_size=6), comment=st.booleans())
def test_strict_env_parser_round_trips_and_rejects_each_defect(env: dict[str, str],
                                                               comment: bool) -> None:
    text = ("# settings\n\n" if comment else "") + "".join(f"{k}={v}\n" for k, v in env.items())
    assert parse_env_strict(text) == env
    key, value = next(iter(env.items()))
    line = f"{key}={value}\n"
    for bad in (f"{key} = {value}\n", f"{key.lower()}x={value}\n", f'{key}="{value}"\n',
                f"export {key}={value}\n", f"{line}{line}"):
        with pytest.raises(ValueError, match="line"):
            parse_env_strict(text.replace(line, bad, 1))
