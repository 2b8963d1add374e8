"""Gymnasium both ways: AgentEnvs pass Gymnasium's own checker behind AgentGymEnv, with
terminated and truncated kept apart; Gymnasium's FrozenLake passes check_env as an AgentEnv,
its RNG captured by the state codec (a codec that leaves it out is caught)."""

import dataclasses

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env as gym_check_env

from closedloop.contracts import Action
from closedloop.envs.check import check_env, check_package
from closedloop.envs.gym_bridge import (
    TOY_TEXT_CODEC,
    AgentGymEnv,
    GymAdapterError,
    GymRules,
    fit_text,
    register,
)
from closedloop.envs.gym_bridge.from_gym import task_lookup
from closedloop.envs.gym_bridge.frozenlake import (
    ACTIONS,
    frozenlake_package,
    lake_task,
    make_lake,
    render_map,
    sample_action,
)
from closedloop.envs.keydoor.package import keydoor_package
from closedloop.envs.sim import SimEnv
from closedloop.envs.sim.env import SnapshotUnsupportedError
from closedloop.errors import ReplayMismatchError


def _terminal_task_ids(n: int = 2) -> list[str]:
    from closedloop.envs.terminal.families.registry import FAMILIES, generate_task

    family = next(iter(FAMILIES.values()))
    return [generate_task(family.family_id, t, 0).spec.task_id for t in family.templates[:n]]


def test_gymnasium_checker_passes_on_the_adapted_terminal_env():
    gym_id = register("terminal-repair-v1", task_ids=_terminal_task_ids(), max_turns=6)
    env = gymnasium.make(gym_id, render_mode="ansi")
    gym_check_env(env.unwrapped)  # spaces, seeding, determinism, data reuse, render modes
    obs, info = env.reset(seed=3)
    assert obs in env.observation_space and info["task_id"] in env.unwrapped.task_ids


@pytest.mark.parametrize("env_id", ["keydoor-v1", "shopping-v1", "searchqa-v1",
                                    "frozenlake-v1"])
def test_gymnasium_checker_passes_on_the_other_packages(env_id):
    env = gymnasium.make(register(env_id), render_mode="ansi")
    gym_check_env(env.unwrapped)


def _keydoor_gym(**kwargs) -> AgentGymEnv:
    return AgentGymEnv(package=keydoor_package(), **kwargs)


def test_terminated_carries_the_verifiers_reward():
    env = _keydoor_gym()
    task_id = env.task_ids[0]
    obs, _ = env.reset(seed=0, options={"task_id": task_id})
    expert = keydoor_package().scripted_policy("expert", task_id, 0)
    rewards = []
    while True:
        action = expert.act(obs)
        obs, reward, terminated, truncated, info = env.step(
            action.canonical_text() if isinstance(action, Action) else action)
        rewards.append(reward)
        if terminated or truncated:
            break
    assert (terminated, truncated, info["scored"]) == (True, False, True)
    assert rewards[-1] == 1.0 and set(rewards[:-1]) == {0.0}
    assert info["termination"] == "agent_finish" and info["reward_components"]["inspected"] == 1


def test_truncation_by_turn_limit_is_not_termination_and_not_a_score():
    env = _keydoor_gym(max_turns=2)
    env.reset(seed=0)
    inspect = Action.tool("inspect").canonical_text()
    assert env.step(inspect)[2:4] == (False, False)
    _, reward, terminated, truncated, info = env.step(inspect)
    assert (terminated, truncated, reward, info["scored"]) == (False, True, 0.0, False)
    assert info["termination"] == "max_step_truncation"


def test_task_budget_ending_is_termination():
    env = _keydoor_gym(split="train")
    tight = next(t for t in env.task_ids if "/tight/" in t)
    env.reset(seed=0, options={"task_id": tight})
    for _ in range(6):
        _, reward, terminated, truncated, info = env.step(Action.tool("inspect").canonical_text())
        if terminated:
            break
    assert (terminated, truncated, info["termination"]) == \
           (True, False, "task_budget_exhausted_terminal")
    assert info["scored"] and reward == 0.0


def test_observations_are_fitted_to_the_text_space():
    text = "caf\u00e9\r\n" + "x" * 20
    fitted = fit_text(text, 8)
    assert fitted == "caf\ufffd\ufffd\nxx" and len(fitted) == 8
    env = _keydoor_gym()
    assert fitted in env.observation_space
    assert text not in env.observation_space


def test_frozenlake_package_passes_check_env_with_fork_checks():
    report = check_package(frozenlake_package())
    assert report.fork_checks == 6 and report.missing == ()


def test_frozenlake_verifier_agrees_with_its_fixtures_within_the_gate_bounds():
    from closedloop.envs.verifier_audit import audit_verifier

    package = frozenlake_package()
    audit = audit_verifier(package.fixtures(None), package.verifier())
    assert (audit.fp, audit.fn, audit.tamper_missed, audit.false_quarantine) == (0, 0, 0, 0)
    assert audit.n_positive == 36 and audit.n_negative >= 36 and audit.n_tamper == 18
    assert audit.fp_ci[1] <= 0.1 and audit.fn_ci[1] <= 0.15


def _slippery(codec=TOY_TEXT_CODEC) -> GymRules:
    desc = ["SFFF", "FHFH", "FFFH", "HFFG"]
    tasks = task_lookup({"lake/slip": lake_task(desc, True, 40), "lake/ice": lake_task(desc,
                                                                                      False, 40)})
    return GymRules("frozenlake-slippery-test", make_lake, tasks, ACTIONS, codec=codec,
                    render_text=render_map)


def _moves(rng, task_id):
    return Action.tool(rng.choice(ACTIONS))


def test_slippery_lake_replays_exactly_because_the_rng_is_in_the_state():
    report = check_env(lambda: SimEnv(_slippery()), ["lake/slip"], seeds=[0, 1, 2],
                       n_random_sequences=6, sequence_length=12, sampler=_moves,
                       probe=lambda t: Action.tool("right"), tool_names=ACTIONS)
    assert report.replays == 18 and report.fork_checks == 3


def test_the_snapshot_rng_hash_follows_the_envs_rng():
    env = SimEnv(_slippery())
    env.reset("lake/slip", 0)
    first = env.snapshot("a")
    env.step(Action.tool("left"))  # every FrozenLake step draws from np_random
    second = env.snapshot("b")
    assert first.rng_state_hash != second.rng_state_hash
    assert "rng" in env.current_state().world() and "rng" not in env.current_state().world()["gym"]


def test_a_codec_that_drops_the_rng_is_caught_by_the_replay_check():
    forgetful = dataclasses.replace(
        TOY_TEXT_CODEC, rng_key=None,
        read=lambda env: {"s": int(env.s), "lastaction": env.lastaction},
        write=lambda env, s: (setattr(env, "s", s["s"]), setattr(env, "lastaction",
                                                                   s["lastaction"])))
    with pytest.raises(ReplayMismatchError):
        check_env(lambda: SimEnv(_slippery(forgetful)), ["lake/slip"], seeds=[0, 1, 2],
                  n_random_sequences=6, sequence_length=12, sampler=_moves,
                  probe=lambda t: Action.tool("right"), tool_names=ACTIONS)


def test_without_a_codec_snapshots_are_refused_by_name():
    env = SimEnv(_slippery(codec=None))
    env.reset("lake/ice", 0)
    assert env.step(Action.tool("down")).error is None  # the live env still steps
    with pytest.raises(SnapshotUnsupportedError, match="no state codec"):
        env.snapshot("s")


def test_only_discrete_action_spaces_are_wrapped():
    class Boxy:
        action_space = gymnasium.spaces.Box(-1.0, 1.0, (1,))

    rules = GymRules("boxy-test", lambda **kw: Boxy(),
                     task_lookup({"t": lake_task(["SG"], False, 5)}), ACTIONS)
    with pytest.raises(GymAdapterError, match="not Discrete"):
        SimEnv(rules).reset("t", 0)


def test_sampler_draws_every_move_and_some_bad_calls():
    import random

    rng = random.Random(0)
    drawn = [sample_action(rng, "any") for _ in range(300)]
    names = {a.name if isinstance(a, Action) else a for a in drawn}
    assert set(ACTIONS) <= names and {"jump", "swim", "north"} & names
