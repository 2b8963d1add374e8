"""Scripted policies through the real environment and verifier."""

from __future__ import annotations

import dataclasses
import json

import pytest

from closedloop.contracts import Action, parse_action
from closedloop.envs.scripted import (
    ExpertPolicy,
    NoisyExpertPolicy,
    RandomPolicy,
    noisy_plan,
    play,
)
from closedloop.envs.terminal import TerminalRepairEnv, Verifier, check_solvable
from closedloop.envs.terminal.families import get_bundle, get_spec
from closedloop.envs.terminal.task_sets import default_task_sets
from closedloop.envs.terminal.workspace import decode_state


@pytest.fixture(scope="module")
def env() -> TerminalRepairEnv:
    return TerminalRepairEnv(get_spec)


def test_expert_solves_every_default_task_through_the_real_env() -> None:
    # Building the default sets plays ExpertPolicy on every candidate through the real env and
    # grades it (check_solvable); a task the expert fails is discarded. None was.
    sets = default_task_sets()
    assert (len(sets.train), len(sets.heldout), sets.discarded) == (48, 16, ())
    lazy = dataclasses.replace(sets.heldout[0], grader=dataclasses.replace(
        sets.heldout[0].grader, gold_actions=(Action.finish(),)))
    rejected = check_solvable(lazy)  # an "expert" that only finishes fails the filter
    assert rejected is not None and "rejected by the grader" in rejected


def test_expert_episodes_are_clean_demonstrations(env: TerminalRepairEnv) -> None:
    sets = default_task_sets()
    verifier = Verifier()
    for bundle in sets.heldout:  # one task of each held-out template per family, and more
        episode = play(env, ExpertPolicy(bundle), bundle.spec.task_id, seed=0)
        assert all(parse_action(t).model_text() == t for t in episode.texts)
        reward = verifier.score(bundle.spec.task_id, episode.final_state)
        assert reward["task_success"] == 1.0
        assert decode_state(episode.final_state).final_action == "finish"
        assert reward["collateral_damage"] == reward["policy_violation"] == 0.0
        assert reward["invalid_actions"] == 0.0
        assert len(episode.texts) <= bundle.spec.step_budget


def test_random_policy_almost_never_solves(env: TerminalRepairEnv) -> None:
    sets = default_task_sets()
    verifier = Verifier()
    solved = quarantined = 0
    for i, bundle in enumerate(sets.heldout):
        episode = play(env, RandomPolicy(seed=100 + i), bundle.spec.task_id, seed=0)
        result = verifier.score_or_quarantine(bundle.spec.task_id, episode.final_state)
        quarantined += result.reward is None
        solved += result.reward is not None and result.reward["task_success"] == 1.0
    print(f"random policy: {solved}/{len(sets.heldout)} held-out tasks solved, "
          f"{quarantined} quarantined")
    assert solved / len(sets.heldout) <= 0.05


def test_random_policy_is_deterministic_and_varied() -> None:
    a = [RandomPolicy(3).act("", ["x"] * i) for i in range(30)]
    b = [RandomPolicy(3).act("", ["x"] * i) for i in range(30)]
    assert a == b
    names = {parse_action(str(t)).name for t in a}
    assert {"read_file", "write_file", "run"} <= names


def test_noisy_expert_makes_mistakes_and_recovers(env: TerminalRepairEnv) -> None:
    sets = default_task_sets()
    verifier = Verifier()
    solved = invalid = errors = 0
    for i, bundle in enumerate(sets.heldout):
        episode = play(env, NoisyExpertPolicy(bundle, error_rate=0.3, seed=i),
                       bundle.spec.task_id, seed=0)
        reward = verifier.score(bundle.spec.task_id, episode.final_state)
        solved += reward["task_success"] == 1.0
        invalid += int(reward["invalid_actions"])
        errors += sum(tr.error is not None for tr in episode.transitions)
    print(f"noisy expert (0.3): solved {solved}/16, {invalid} invalid actions, "
          f"{errors} error observations")
    assert solved >= 13
    assert invalid > 0 and errors > invalid  # malformed calls and wrong paths/edits happened


def test_noisy_plan_wrong_edit_is_followed_by_check_and_fix() -> None:
    bundle = get_bundle(default_task_sets().train[12].spec.task_id)  # a json task
    plans = [noisy_plan(bundle, 1.0, seed) for seed in range(40)]
    with_edit = [p for p in plans if any("~" in t for t in p)]
    assert with_edit, "no wrong edit drawn in 40 seeds"
    plan = with_edit[0]
    k = next(i for i, t in enumerate(plan) if "~" in t)
    assert parse_action(plan[k + 1]) == Action.tool("run", command="check")
    assert "~" in json.dumps(parse_action(plan[k + 2]).args) or \
        parse_action(plan[k + 2]).name == "write_file"
    assert all(len(p) <= bundle.spec.step_budget for p in plans)


def test_noisy_plan_wrong_old_fails_cleanly_then_the_right_replace_follows(
        env: TerminalRepairEnv) -> None:
    sets = default_task_sets()
    seen = 0
    for bundle in sets.train + sets.heldout:
        gold = [a for a in bundle.grader.gold_actions if a.name == "replace"]
        for seed in range(12):
            plan = noisy_plan(bundle, 1.0, seed)
            for k, text in enumerate(plan[:-1]):
                try:
                    call = parse_action(text)
                except Exception:
                    continue
                if (call.name != "replace" or call in gold or "~" in json.dumps(call.args)
                        or call.args.get("path") not in bundle.spec.initial_files):
                    continue  # not a wrong_old slip (a right call, a wrong edit or path)
                assert parse_action(plan[k + 1]) in gold  # the right replace comes next
                assert call.args["old"] not in bundle.spec.initial_files[call.args["path"]]
                env.reset(bundle.spec.task_id, 0)
                before = decode_state(env.export_state()).files
                transition = env.step(text)
                assert transition.error is not None and "not_found" in transition.observation
                assert decode_state(env.export_state()).files == before  # nothing changed
                seen += 1
    assert seen >= 10, "wrong_old was never drawn"


def test_noisy_expert_at_zero_error_rate_is_the_expert() -> None:
    bundle = get_bundle(default_task_sets().heldout[0].spec.task_id)
    assert NoisyExpertPolicy(bundle, 0.0, seed=5).plan == ExpertPolicy(bundle).plan
    with pytest.raises(ValueError):
        NoisyExpertPolicy(bundle, 1.5)


def test_policies_use_history_length_as_step_index() -> None:
    bundle = get_bundle(default_task_sets().train[0].spec.task_id)
    expert = ExpertPolicy(bundle)
    gold = [a.model_text() for a in bundle.grader.gold_actions]
    assert expert.act("obs", gold[:2]) == gold[2]
    assert expert.act("obs", gold * 3) == Action.finish().model_text()
