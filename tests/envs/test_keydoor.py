"""Key-and-door (seed 002 §11.5.4): the package passes check_env with fork checks, the colour
stays hidden until inspect (masks included), the expert solves, the verifier agrees with the
adjudicated fixtures."""

import random

import pytest

from closedloop.contracts import Action, Termination
from closedloop.contracts.package import TaskSetRequest
from closedloop.envs.check import check_package
from closedloop.envs.discovery import resolve_package
from closedloop.envs.keydoor import ACTIONS, CATALOG, KeyDoorExpert, KeyDoorRules, available
from closedloop.envs.keydoor.package import keydoor_package
from closedloop.envs.keydoor.rules import opening_from
from closedloop.envs.sim import SimEnv
from closedloop.envs.verifier_audit import audit_verifier

PKG = keydoor_package()


def test_check_package_runs_the_envs_own_actions_and_fork_checks():
    tasks = [CATALOG.generate("keydoor-v1", t, i).task_id
             for t in ("standard", "tight", "prekeyed") for i in range(2)]
    report = check_package(PKG, tasks, seeds=(0, 3), n_random_sequences=3)
    assert report.fork_checks == 12 and report.replays == 36 and report.missing == ()
    assert report.sampler_actions > 300 and report.package_checks == 7


def test_registered_as_a_builtin():
    assert resolve_package("keydoor-v1") is PKG


def test_splits_are_template_disjoint_and_colours_balanced():
    sets = PKG.task_sets(TaskSetRequest(32, 16))
    assert {t.split("/")[1] for t in sets.train} == {"standard", "tight"}
    assert {t.split("/")[1] for t in sets.heldout} == {"prekeyed"}
    targets = [CATALOG.task(t).hidden["target"] for t in sets.train]
    assert 8 <= targets.count("red") <= 24


def _play(env: SimEnv, policy: KeyDoorExpert, task_id: str) -> SimEnv:
    obs = env.reset(task_id, 0)
    for _ in range(20):
        t = env.step(policy.act(obs))
        obs = t.observation
        if t.done:
            break
    return env


def test_the_expert_solves_every_task_from_observations_alone():
    verifier = PKG.verifier()
    sets = PKG.task_sets(TaskSetRequest(32, 16))
    for task_id in sets.train + sets.heldout:
        env = _play(PKG.make_env(), KeyDoorExpert(), task_id)
        result = verifier.score_or_quarantine(task_id, env.export_state())
        assert result.success == 1.0, (task_id, result)
        assert result.reward["inspected"] == 1.0


def test_noise_costs_time_and_fails_tight_tasks_sometimes():
    verifier = PKG.verifier()
    tight = [CATALOG.generate("keydoor-v1", "tight", i).task_id for i in range(16)]
    wins = [verifier.score_or_quarantine(t, _play(PKG.make_env(), KeyDoorExpert(i, 0.6), t)
                                         .export_state()).success for i, t in enumerate(tight)]
    assert 0 < sum(wins) < len(wins)


def test_masks_follow_the_phase():
    assert available({"key": None, "door": None}) == ("inspect", "pickup_red", "pickup_blue",
                                                      "finish")
    assert available({"key": "red", "door": None}) == ("inspect", "pickup_blue", "open_red",
                                                       "finish")
    assert available({"key": "red", "door": "red"}) == ("finish",)
    env = SimEnv(KeyDoorRules())
    env.reset(CATALOG.generate("keydoor-v1", "standard", 0).task_id, 0)
    t = env.step(Action.tool("open_red"))
    assert t.error == "action_masked"
    assert env.current_state().world()["door"] is None


class _Swapped(KeyDoorRules):
    """The same task with the other colour in the clue (so with the other target)."""

    def opening(self, task_id, seed):
        task = self.catalog.task(task_id)
        target = task.hidden["target"]
        other = "blue" if target == "red" else "red"
        public = {**task.public, "clue": task.public["clue"].replace(target, other)}
        return opening_from(public, task.objective, task.budget)


class _LeakyMask(_Swapped):
    """A broken variant whose status line leaks the clue (the test below must catch it)."""

    def apply(self, world, action):
        out = super().apply(world, action)
        return type(out)(out.observation + world["clue"], out.error, out.world, out.cost,
                         out.end, out.final_action)


def _colour_blind(rules_a, rules_b, n_sequences: int = 60) -> bool:
    """Whether every inspect-free action sequence sees the same observations in both."""
    names = [a for a in ACTIONS if a not in ("inspect", "finish")]
    for i in range(n_sequences):
        task_id = CATALOG.generate("keydoor-v1", ("standard", "prekeyed")[i % 2], i).task_id
        rng = random.Random(i)
        a, b = SimEnv(rules_a), SimEnv(rules_b)
        if a.reset(task_id, 0) != b.reset(task_id, 0):
            return False
        for _ in range(8):
            action = Action.tool(rng.choice(names))
            ta, tb = a.step(action), b.step(action)
            if ta.observation != tb.observation or ta.error != tb.error:
                return False
            if ta.done:
                break
    return True


def test_no_observation_before_inspect_depends_on_the_exit_colour():
    assert _colour_blind(KeyDoorRules(), _Swapped())
    assert not _colour_blind(KeyDoorRules(), _LeakyMask())


def test_inspect_shows_the_clue_and_durations_fill_the_tight_budget():
    task = CATALOG.generate("keydoor-v1", "tight", 1)
    target = task.hidden["target"]
    env = SimEnv(KeyDoorRules())
    env.reset(task.task_id, 0)
    assert target in env.step(Action.tool("inspect")).observation.split("You hold")[0]
    env.step(Action.tool(f"pickup_{target}"))
    env.step(Action.tool(f"open_{target}"))
    assert env.current_state().clock == 5
    t = env.step(Action.finish())
    assert t.termination is Termination.AGENT_FINISH and env.current_state().clock == 6
    env.reset(task.task_id, 0)
    for action in ("inspect", "inspect", f"pickup_{target}"):
        env.step(Action.tool(action))
    t = env.step(Action.tool(f"open_{target}"))  # 2 + 2 + 1 + 2 = 7 > 6
    assert t.termination is Termination.TASK_BUDGET_EXHAUSTED_TERMINAL


def test_verifier_agrees_with_every_adjudicated_fixture():
    fixtures = PKG.fixtures(None)
    assert len(fixtures) == 18 * 6
    audit = audit_verifier(fixtures, PKG.verifier())
    assert (audit.fp, audit.fn, audit.tamper_missed) == (0, 0, 0)
    assert (audit.n_positive, audit.n_negative, audit.n_tamper) == (36, 54, 18)
    assert audit.fp_ci[1] <= 0.1 and audit.fn_ci[1] <= 0.15  # the gate's bounds


@pytest.mark.parametrize("edit", [b"", b"{}", b"not json"])
def test_corrupt_exports_are_unscored(edit):
    task_id = CATALOG.generate("keydoor-v1", "standard", 0).task_id
    result = PKG.verifier().score_or_quarantine(task_id, edit)
    assert result.reward is None and result.quarantine_reason.startswith("invalid_state")
