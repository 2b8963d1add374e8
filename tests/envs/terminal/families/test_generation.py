"""Task generation: determinism, ids, the draft contract, and what stays hidden."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from closedloop.contracts import Action
from closedloop.envs.terminal.families import (
    FAMILIES,
    FAMILY_IDS,
    HELDOUT_FAMILIES,
    TaskDraft,
    TaskGenerationError,
    UnknownTaskError,
    build_bundle,
    generate_task,
    get_bundle,
    get_grader,
    get_spec,
    parse_task_id,
)
from closedloop.envs.terminal.families.base import (
    MAX_FILE_CHARS,
    MAX_GOLD_ACTIONS,
    TemplateFamily,
    assemble_bundle,
    template_level,
)
from closedloop.envs.terminal.families.registry import generate_task as cached_generate

ALL_TEMPLATES = [(f.family_id, t) for f in FAMILIES.values() for t in f.templates]
WITH_HELDOUT = {**FAMILIES, **HELDOUT_FAMILIES}  # training + family-disjoint held-out families
EVERY_TEMPLATE = [(f.family_id, t) for f in WITH_HELDOUT.values() for t in f.templates]


def test_four_versioned_families_with_leveled_templates() -> None:
    assert FAMILY_IDS == ("file-repair-v1", "json-repair-v1", "schema-repair-v1",
                          "cli-repair-v1")
    for family in FAMILIES.values():
        assert len(family.base_templates) >= 6
        assert len(family.heldout_templates) == 2
        assert set(family.heldout_templates) < set(family.base_templates)
        assert family.templates == tuple(f"{b}.{lv}" for b in family.base_templates
                                         for lv in family.levels)
    assert len(ALL_TEMPLATES) == sum(len(f.base_templates) * len(f.levels)
                                     for f in FAMILIES.values())


@settings(max_examples=25, deadline=None)
@given(pair=st.sampled_from(EVERY_TEMPLATE), index=st.integers(0, 9999))
def test_generation_is_deterministic_and_ignores_global_state(pair: tuple[str, str],
                                                              index: int) -> None:
    family, template = pair
    random.seed(1)
    a = build_bundle(WITH_HELDOUT[family], template, index)
    random.seed(2)
    b = build_bundle(WITH_HELDOUT[family], template, index)
    assert a == b
    assert a.spec.task_id == b.spec.task_id
    assert parse_task_id(a.spec.task_id) == (family, template, index)


def test_same_id_same_bundle_and_different_index_different_task() -> None:
    a = generate_task("json-repair-v1", "wrong-type.symptom", 3)
    assert get_bundle(a.spec.task_id) is a  # memoized lookup
    assert get_spec(a.spec.task_id) == a.spec
    assert get_grader(a.spec.task_id) == a.grader
    b = generate_task("json-repair-v1", "wrong-type.symptom", 4)
    assert a.spec.task_id != b.spec.task_id
    assert a.spec.initial_files != b.spec.initial_files


def test_task_id_is_content_hashed_and_checked() -> None:
    bundle = generate_task("json-repair-v1", "wrong-type.exact", 7)
    family, template, rest = bundle.spec.task_id.split("/")
    assert (family, template) == ("json-repair-v1", "wrong-type.exact")
    assert bundle.spec.hint_level == "exact"
    assert rest.startswith("007-") and len(rest) == len("007-") + 8
    forged = bundle.spec.task_id[:-1] + ("0" if bundle.spec.task_id[-1] != "0" else "1")
    with pytest.raises(UnknownTaskError, match="does not match"):
        get_bundle(forged)
    for bad in ("json-repair-v1/wrong-type", "nope/x/001-abcdef01", "", "a/b/1-abcdef01",
                "json-repair-v1/wrong-type/007-" + rest[-8:],  # a base name is not a template
                "json-repair-v1/wrong-type.hard/007-" + rest[-8:]):
        with pytest.raises(UnknownTaskError):
            get_bundle(bad)
    for template in ("no-such-template", "wrong-type", "wrong-type.hard", "no-such.exact"):
        with pytest.raises(UnknownTaskError, match="no template"):
            generate_task("json-repair-v1", template, 0)


@pytest.mark.parametrize(("family", "template"), EVERY_TEMPLATE)
def test_every_template_respects_the_task_contract(family: str, template: str) -> None:
    for index in range(3):
        bundle = cached_generate(family, template, index)
        spec, grader = bundle.spec, bundle.grader
        base, level = template_level(template)
        assert (spec.template, spec.hint_level) == (template, level)
        assert spec.split == ("heldout" if base in WITH_HELDOUT[family].heldout_templates
                              else "train")
        assert spec.step_budget == 8
        assert 1 <= len(grader.gold_actions) <= min(MAX_GOLD_ACTIONS, spec.step_budget)
        assert grader.gold_actions[-1] == Action.finish()
        assert all(len(text) < MAX_FILE_CHARS for text in spec.initial_files.values())
        assert "check" in spec.commands
        assert "check.py" in spec.initial_files
        assert "check.py" in grader.extra["validator_hashes"]
        assert spec.protected_paths  # every task has an invariant to keep
        assert set(spec.protected_paths) <= set(spec.initial_files)
        assert set(grader.protected_hashes) == set(spec.protected_paths)
        # the objective names a file of the workspace and is 1-3 sentences
        assert any(p in spec.objective for p in spec.initial_files)
        assert 1 <= spec.objective.count(". ") + 1 <= 4
        # the noisy expert's corruption marker never occurs in generated files
        assert not any("~" in text for text in spec.initial_files.values())
        # gold actions only use allowed tools and allowlisted commands
        for action in grader.gold_actions:
            if action.kind == "tool":
                assert action.name in spec.allowed_tools
                if action.name == "run":
                    assert action.args["command"] in spec.commands


@pytest.mark.parametrize("template", FAMILIES["cli-repair-v1"].templates)
def test_cli_hidden_inputs_and_outputs_stay_out_of_the_workspace(template: str) -> None:
    bundle = generate_task("cli-repair-v1", template, 1)
    cases = bundle.grader.checks["cases"]
    assert len(cases) == 3
    visible = bundle.spec.initial_files["input.txt"]
    assert cases[0]["input"] == visible
    workspace = "\n".join(bundle.spec.initial_files.values())
    for case in cases[1:]:
        assert case["input"] != visible
        assert case["input"] not in workspace
    assert len({c["expected"] for c in cases}) == 3  # hard-coding one output cannot pass


def test_json_reference_value_is_not_a_workspace_file() -> None:
    bundle = generate_task("json-repair-v1", "trailing-comma.symptom", 2)
    path = bundle.grader.checks["path"]
    with pytest.raises(ValueError):
        json.loads(bundle.spec.initial_files[path])  # the workspace copy is broken


def _draft(**overrides: object) -> TaskDraft:
    base: dict[str, object] = dict(
        objective="Fix a.txt.", initial_files={"a.txt": "x\n", "check.py": "print('OK')\n"},
        commands={"check": ("python3", "check.py")}, protected_paths=(),
        validator_paths=("check.py",), checks={"kind": "lines_equal", "path": "a.txt",
                                               "expected": ["y"]},
        gold_actions=(Action.tool("write_file", path="a.txt", content="y\n"), Action.finish()))
    base.update(overrides)
    return TaskDraft(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(("overrides", "message"), [
    ({"initial_files": {"a.txt": "x" * MAX_FILE_CHARS, "check.py": ""}}, "chars"),
    ({"protected_paths": ("README.md",)}, "not in the files"),
    ({"gold_actions": (Action.tool("read_file", path="a.txt"),) * 6 + (Action.finish(),)},
     "gold solution has 7"),
    ({"gold_actions": (Action.tool("read_file", path="a.txt"),)}, "end with finish"),
    ({"checks": {"path": "a.txt"}}, "kind"),
    ({"initial_files": {"a.txt": "x", "check.py": "", ".grader/x": "1"}}, "reserved"),
    ({"objective": "  "}, "objective"),
])
def test_broken_drafts_are_refused(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(TaskGenerationError, match=message):
        assemble_bundle("t-v1", "tpl", 0, "train", _draft(**overrides))


def test_template_family_rejects_unknown_template() -> None:
    fam = TemplateFamily("t-v1", {"tpl": lambda rng: _draft()}, heldout_templates=(),
                         levels=())
    assert fam.templates == fam.base_templates == ("tpl",)
    assert build_bundle(fam, "tpl", 0).spec.task_id.startswith("t-v1/tpl/000-")
    with pytest.raises(UnknownTaskError):
        build_bundle(fam, "other", 0)
    with pytest.raises(UnknownTaskError):
        build_bundle(fam, "tpl.symptom", 0)


def test_a_level_the_builder_did_not_write_is_a_generation_error() -> None:
    hinted = TemplateFamily("t-v1", {"tpl": lambda rng: _draft(hints={"exact": "Do x.txt."})},
                            heldout_templates=("tpl",))
    assert hinted.templates == ("tpl.exact", "tpl.located", "tpl.symptom")
    exact = build_bundle(hinted, "tpl.exact", 0)
    assert (exact.spec.objective, exact.spec.hint_level, exact.spec.split) == (
        "Do x.txt.", "exact", "heldout")
    assert build_bundle(hinted, "tpl.symptom", 0).spec.objective == "Fix a.txt."
    with pytest.raises(TaskGenerationError, match="located"):
        build_bundle(hinted, "tpl.located", 0)
    with pytest.raises(UnknownTaskError):
        build_bundle(hinted, "tpl", 0)  # a base name is not a template of a leveled family
