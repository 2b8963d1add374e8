"""``rules_package``: the short Rules route derives a checkable package from rules, a catalog, a
grade and an expert plan (a counter that must reach a target, written here as a user would)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from closedloop.contracts import Action
from closedloop.contracts.package import TaskSetRequest
from closedloop.envs import check_package
from closedloop.envs.sim import (
    Grade,
    Opening,
    Outcome,
    SimFamily,
    TaskCatalog,
    TaskDraft,
    error_outcome,
    rules_package,
)
from closedloop.envs.sim.simple import tool_sampler
from closedloop.errors import EnvPackageError, TaskError, VerifierCheckError

TOOLS = ({"name": "add", "description": "Add n (1-3) to the counter.",
          "parameters": {"n": "integer"}},)


def _draft(template: str, index: int, rng: random.Random) -> TaskDraft:
    target = rng.randrange(2, 7) * (2 if template == "even" else 1)
    return TaskDraft(f"Reach {target}, then finish.", {}, {"target": target}, 12)


CATALOG = TaskCatalog([SimFamily("counter-v1", {"any": "train", "even": "heldout"}, _draft)], 4)


class Counter:
    env_version = "counter-v1"

    def opening(self, task_id: str, seed: int) -> Opening:
        return Opening({"n": 0}, CATALOG.task(task_id).budget, "The counter is at 0.")

    def apply(self, world: Any, action: Action) -> Outcome:
        n = action.args.get("n")
        if action.name != "add" or n not in (1, 2, 3) or isinstance(n, bool):
            return error_outcome("bad_call", "add(n) with n in 1-3")
        return Outcome(f"The counter is at {world['n'] + n}.", world={"n": world["n"] + n})


def plan(task: Any) -> list[Action]:
    target = task.hidden["target"]
    return [Action.tool("add", n=min(3, target - 3 * i)) for i in range((target + 2) // 3)]


def package(grade: Any = None, **changes: Any) -> Any:
    return rules_package(
        env_id="counter-v1", rules=Counter, catalog=CATALOG, tools=TOOLS,
        system_prompt="You count.", expert=plan,
        grade=grade or (lambda task, state: state.world()["n"] == task.hidden["target"]
                        and state.final_action == "finish"), **changes)


def test_a_rules_package_passes_check_package_with_its_own_sampler_and_forks() -> None:
    report = check_package(package())
    assert report.sampler_actions > 0 and report.fork_checks > 0 and report.package_checks == 4
    assert report.missing == ()
    pkg = package()
    assert pkg.missing() == ("fork_probe", "fixtures", "retain_tasks")
    assert pkg.make_verifier().verifier_version == "counter-v1-verifier"
    sets = pkg.task_sets(TaskSetRequest(3, 2, 0))
    assert {pkg.task_info(t).split for t in sets.heldout} == {"heldout"}


def test_a_grade_that_accepts_the_reset_state_fails_the_package_check() -> None:
    with pytest.raises(VerifierCheckError, match="accepts the untouched reset state"):
        check_package(package(grade=lambda task, state: True))


@pytest.mark.parametrize("result, success", [(True, 1.0), (0.5, 0.5),
                                             (Grade(1.0, {"x": 2.0}, "ok"), 1.0)])
def test_a_grade_may_be_a_bool_a_float_or_a_grade(result: Any, success: float) -> None:
    pkg = package(grade=lambda task, state: result)
    env = pkg.make_env()
    task = pkg.task_sets(TaskSetRequest(1, 0, 0)).train[0]
    env.reset(task, 0)
    score = pkg.verifier().score_or_quarantine(task, env.export_state())
    assert score.success == success and score.reward is not None
    assert {"tool_calls", "time_used"} <= set(score.reward)


def test_a_grade_of_another_type_is_a_programming_error_that_stops_the_run() -> None:
    # only declared failures leave an episode unscored; a grade of the wrong type is the
    # package's bug, raised with a note naming the verifier and the task
    pkg = package(grade=lambda task, state: "yes")
    env = pkg.make_env()
    task = pkg.task_sets(TaskSetRequest(1, 0, 0)).train[0]
    env.reset(task, 0)
    with pytest.raises(TaskError, match="returned str") as err:
        pkg.verifier().score_or_quarantine(task, env.export_state())
    assert any(task in note for note in getattr(err.value, "__notes__", []))


def test_the_scripted_policies_follow_the_plan_with_their_own_noise_seed() -> None:
    pkg = package()
    task = pkg.task_sets(TaskSetRequest(1, 0, 0)).train[0]
    gold = plan(CATALOG.task(task))
    expert = pkg.scripted_policy("expert", task, 0)
    assert [expert.act("") for _ in gold] + [expert.act("")] == [*gold, Action.finish()]
    clean = pkg.scripted_policy("noisy", task, 5, 0.0)
    assert [clean.act("") for _ in gold] == gold
    noisy = pkg.scripted_policy("noisy", task, 5, 1.0)  # a broken call before every step
    played = [noisy.act("") for _ in range(2 * len(gold))]
    assert played[1::2] == gold and all(isinstance(t, str) and "</tool_call>" not in t
                                        for t in played[0::2])
    a, b = (pkg.scripted_policy("random", task, s) for s in (1, 2))
    assert [a.act("") for _ in range(3)] != [b.act("") for _ in range(3)]


def test_the_sampler_calls_the_declared_tools_and_sometimes_an_unknown_one() -> None:
    sample = tool_sampler(TOOLS)
    rng = random.Random(0)
    names = [a.name for a in (sample(rng, "t") for _ in range(200)) if isinstance(a, Action)]
    assert set(names) == {"add", "no_such_tool"} and names.count("add") > 150


def test_without_an_expert_there_are_no_scripted_policies() -> None:
    pkg = rules_package(env_id="counter-v1", rules=Counter, catalog=CATALOG, tools=TOOLS,
                        system_prompt="You count.", grade=lambda task, state: False)
    with pytest.raises(EnvPackageError, match="offers no 'noisy'"):
        pkg.scripted_policy("noisy", "x", 0)
