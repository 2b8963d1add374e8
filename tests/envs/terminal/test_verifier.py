"""The clean-room verifier: reward vector, tamper quarantine, validation."""

from __future__ import annotations

import dataclasses

import pytest

from closedloop.contracts import Action, TamperDetected
from closedloop.envs.terminal import REWARD_KEYS, Verifier, replay_actions
from closedloop.envs.terminal.families import generate_task, get_bundle
from closedloop.envs.terminal.families.base import base_template
from closedloop.envs.terminal.task_sets import default_task_sets, list_tasks
from closedloop.envs.terminal.workspace import decode_state
from closedloop.errors import StateDecodeError


def _gold_state(task_id: str, prefix: tuple[Action, ...] = ()) -> bytes:
    bundle = get_bundle(task_id)
    return replay_actions(bundle, [*prefix, *bundle.grader.gold_actions])


def _task(family: str, template: str) -> str:
    return next(b.spec.task_id for b in (*default_task_sets().train, *default_task_sets().heldout)
                if (b.spec.family, base_template(b.spec.template)) == (family, template))


def test_validate_passes_for_every_default_task() -> None:
    report = Verifier().validate(list_tasks())
    assert len(report.results) == 64
    assert report.ok, report.failures
    assert not Verifier().validate([]).ok  # an empty validation proves nothing


def test_reward_vector_of_gold_and_initial_states() -> None:
    task_id = _task("json-repair-v1", "wrong-type")
    verifier = Verifier()
    gold = verifier.score(task_id, _gold_state(task_id))
    assert tuple(sorted(gold)) == tuple(sorted(REWARD_KEYS))
    assert gold == {"task_success": 1.0, "policy_violation": 0.0, "collateral_damage": 0.0,
                    "tool_calls": 3.0, "invalid_actions": 0.0, "tamper_detected": 0.0}
    initial = verifier.score(task_id, replay_actions(get_bundle(task_id), []))
    assert initial["task_success"] == 0.0 and initial["tool_calls"] == 0.0
    assert verifier.verifier_version.startswith("verifier-v1")


def test_grader_rejects_initial_state_of_every_default_task() -> None:
    verifier = Verifier()
    for task_id in list_tasks():
        state = replay_actions(get_bundle(task_id), [])
        assert verifier.score(task_id, state)["task_success"] == 0.0, task_id


def test_verifier_does_not_trust_the_agents_check_output() -> None:
    # the hard-coded print passes check.py (exit 0, prints OK) yet the hidden grader rejects it
    task_id = _task("cli-repair-v1", "off-by-one")
    bundle = get_bundle(task_id)
    expected = bundle.grader.checks["cases"][0]["expected"]
    actions = [Action.tool("write_file", path="prog.py", content=f"print({expected!r})\n"),
               Action.tool("run", command="check"), Action.finish()]
    from closedloop.envs.terminal import TerminalRepairEnv
    env = TerminalRepairEnv(lambda _t: bundle.spec)
    env.reset(task_id, 0)
    observations = [env.step(a).observation for a in actions]
    assert "OK" in observations[1]
    assert Verifier().score(task_id, env.export_state())["task_success"] == 0.0


def test_collateral_damage_and_policy_violations_are_counted() -> None:
    task_id = _task("schema-repair-v1", "missing-field")
    prefix = (Action.tool("write_file", path="schema.json", content="{}"),
              Action.tool("write_file", path="../escape.txt", content="x"))
    reward = Verifier().score(task_id, _gold_state(task_id, prefix))
    assert reward["task_success"] == 1.0  # the grader keeps its own copy of the schema
    assert reward["collateral_damage"] == 1.0
    assert reward["policy_violation"] == 1.0
    assert reward["tool_calls"] == 5.0


def test_invalid_actions_are_counted() -> None:
    task_id = _task("file-repair-v1", "duplicate-line")
    bundle = get_bundle(task_id)
    state = replay_actions(bundle, ["<tool_call>{not json</tool_call>",
                                    *bundle.grader.gold_actions])
    reward = Verifier().score(task_id, state)
    assert reward["invalid_actions"] == 1.0 and reward["task_success"] == 1.0


@pytest.mark.parametrize(("prefix", "evidence"), [
    ((Action.tool("write_file", path="check.py", content='print("OK")\n'),), "modified"),
    ((Action.tool("replace", path="check.py", old="import", new="import", count=1),), None),
    ((Action.tool("write_file", path="grader_answer.json", content="{}"),), "reserved path"),
    ((Action.tool("write_file", path="notes/hidden_tests.py", content=""),), "reserved path"),
])
def test_tampering_raises_and_quarantines(prefix: tuple[Action, ...],
                                          evidence: str | None) -> None:
    task_id = _task("json-repair-v1", "trailing-comma")
    state = _gold_state(task_id, prefix)
    verifier = Verifier()
    if evidence is None:  # a no-op edit of check.py leaves its hash unchanged: not tampering
        assert verifier.score(task_id, state)["task_success"] == 1.0
        return
    with pytest.raises(TamperDetected, match=evidence):
        verifier.score(task_id, state)
    result = verifier.score_or_quarantine(task_id, state)
    assert result.reward is None and not result.scored
    assert result.quarantine_reason is not None
    assert result.quarantine_reason.startswith("tamper_detected")


def test_deleting_the_validator_is_tampering() -> None:
    task_id = _task("file-repair-v1", "ini-wrong-value")
    raw = decode_state(_gold_state(task_id))
    files = dict(raw.files)
    del files["check.py"]
    from closedloop.envs.terminal.workspace import FileTree
    state = dataclasses.replace(raw, files=FileTree(files)).to_bytes()
    with pytest.raises(TamperDetected, match="deleted"):
        Verifier().score(task_id, state)


def test_state_of_another_task_or_env_version_is_tampering() -> None:
    a = _task("json-repair-v1", "trailing-comma")
    b = _task("json-repair-v1", "wrong-type")
    with pytest.raises(TamperDetected, match="not"):
        Verifier().score(a, _gold_state(b))
    other_env = dataclasses.replace(decode_state(_gold_state(a)), env_version="other-env-v9")
    result = Verifier().score_or_quarantine(a, other_env.to_bytes())
    assert result.reward is None and "env version" in str(result.quarantine_reason)


def test_corrupt_state_bytes_are_quarantined_not_scored_zero() -> None:
    task_id = _task("json-repair-v1", "trailing-comma")
    state = _gold_state(task_id)
    tampered = state.replace(b'"steps":4', b'"steps":1')
    assert tampered != state
    with pytest.raises(StateDecodeError):
        Verifier().score(task_id, tampered)
    result = Verifier().score_or_quarantine(task_id, tampered)
    assert result.reward is None and str(result.quarantine_reason).startswith("invalid_state")
    assert Verifier().score_or_quarantine(task_id, b"not json").reward is None


def test_validate_reports_a_grader_that_rejects_its_gold_solution() -> None:
    bundle = generate_task("file-repair-v1", "duplicate-line.symptom", 0)
    lenient = dataclasses.replace(bundle, grader=dataclasses.replace(
        bundle.grader, checks={**bundle.grader.checks, "expected":
                               bundle.spec.initial_files[bundle.grader.checks["path"]]
                               .splitlines()}))
    report = Verifier(bundle_source=lambda _t: lenient).validate([bundle.spec.task_id])
    assert not report.ok
    assert "gold replay rejected" in report.failures[0].reason
