"""A Gymnasium environment as an ``AgentEnv``: ``GymRules`` under ``SimEnv``.

The Gymnasium env must have a ``Discrete`` action space; each action index gets a tool name
(``action_names``, e.g. FrozenLake's ``left, down, right, up``), called without arguments. A
``GymTask`` names the env factory's keyword arguments, the reset seed offset and the budget.

Snapshots by state, where the env's state can be read and written: a ``StateCodec`` reads the
env's whole mutable state as JSON (``TOY_TEXT_CODEC``: the discrete state ``s``, ``lastaction``
and the ``np_random`` bit-generator state, which covers FrozenLake, CliffWalking and Taxi) and
writes it back. The world then holds that JSON, so ``GymRules.apply`` is pure: it writes the
world's state into its (reused) env, steps it and reads the state back, and ``SimEnv``'s
snapshots, restores and forks follow. Without a codec the rules step one live env and refuse
every snapshot, restore and fork (``SnapshotUnsupportedError``, naming the env) rather than
pretend.

World: ``gym`` (the codec's state, or ``None``), ``rng`` (the part of it under the codec's
``rng_key``, kept apart so the snapshot's ``rng_state_hash`` covers the env's RNG), ``obs`` (the
last observation as JSON),
``return`` (sum of rewards), ``last_reward``, ``terminated``. The env's own ``terminated`` ends
the episode with ``env_terminal_success`` when the return is positive, else
``env_terminal_failure`` (the env's own signal; the verifier scores from the exported return);
its ``truncated`` ends it with ``max_step_truncation`` (censored). Observations are the env's
text rendering (``render_text(env, obs)``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from closedloop.contracts import Action, Termination
from closedloop.contracts.package import Opening, Outcome
from closedloop.envs.sim.env import error_outcome
from closedloop.errors import GymAdapterError, TaskError


@dataclass(frozen=True)
class StateCodec:
    """Reads a Gymnasium env's whole mutable state as JSON and writes it back."""

    name: str
    read: Callable[[Any], dict[str, Any]]
    write: Callable[[Any, Mapping[str, Any]], None]
    rng_key: str | None = "rng"


def _read_toy_text(env: Any) -> dict[str, Any]:
    last = env.lastaction
    return {"s": int(env.s), "lastaction": None if last is None else int(last),
            "rng": env.np_random.bit_generator.state}


def _write_toy_text(env: Any, state: Mapping[str, Any]) -> None:
    env.s = state["s"]
    env.lastaction = state["lastaction"]
    env.np_random.bit_generator.state = dict(state["rng"])


TOY_TEXT_CODEC = StateCodec("toy-text-v1", _read_toy_text, _write_toy_text)
"""The state of Gymnasium's discrete toy-text envs: ``s``, ``lastaction`` and the RNG."""


@dataclass(frozen=True)
class GymTask:
    """One task: keyword arguments for the env factory, a reset-seed offset, a budget."""

    kwargs: Mapping[str, Any] = field(default_factory=dict)
    seed_offset: int = 0
    budget: int = 50
    objective: str = ""


def strip_ansi(text: str) -> str:
    """``text`` without ANSI escape sequences (Gymnasium's ``ansi`` renders colour the agent)."""
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def default_render(env: Any, obs: Any) -> str:
    """The env's ``ansi`` rendering without escape codes, else the observation's repr."""
    if getattr(env, "render_mode", None) == "ansi":
        return strip_ansi(str(env.render())).strip("\n")
    return f"observation: {obs!r}"


class GymRules:
    """``Rules`` over a Gymnasium env factory (see the module docstring)."""

    def __init__(self, env_version: str, make: Callable[..., Any],
                 tasks: Callable[[str], GymTask], action_names: Sequence[str],
                 codec: StateCodec | None = TOY_TEXT_CODEC,
                 render_text: Callable[[Any, Any], str] = default_render) -> None:
        self.env_version = env_version
        self._make = make
        self._tasks = tasks
        self.action_names = tuple(action_names)
        self.codec = codec
        self._render = render_text
        self._envs: dict[str, Any] = {}
        self.snapshot_refusal: str | None = None if codec is not None else (
            "the Gymnasium env has no state codec: its state cannot be read or written, so it "
            "cannot be snapshotted, restored or forked")

    def _env(self, task_id: str) -> Any:
        env = self._envs.get(task_id)
        if env is None:
            env = self._make(**dict(self._tasks(task_id).kwargs))
            space = env.action_space
            import gymnasium

            if not isinstance(space, gymnasium.spaces.Discrete):
                raise GymAdapterError(f"{self.env_version}: the action space is "
                                      f"{type(space).__name__}, not Discrete")
            if int(space.n) != len(self.action_names):
                raise GymAdapterError(f"{self.env_version}: {space.n} actions but "
                                      f"{len(self.action_names)} action names")
            self._envs[task_id] = env
        return env

    def opening(self, task_id: str, seed: int) -> Opening:
        """Reset the env with ``seed + task.seed_offset``; the world holds its state."""
        task = self._tasks(task_id)
        env = self._env(task_id)
        obs, _ = env.reset(seed=seed + task.seed_offset)
        world = {"task_id": task_id, **self._read(env), "obs": _jsonable(env, obs),
                 "return": 0.0, "last_reward": 0.0, "terminated": False}
        text = (f"{task.objective} Actions: {', '.join(self.action_names)}. You have "
                f"{task.budget} moves.\n{self._render(env, obs)}")
        return Opening(world, task.budget, text)

    def apply(self, world: Mapping[str, Any], action: Action) -> Outcome:
        """Step the env by the named action from the world's state."""
        if action.name not in self.action_names:
            return error_outcome("unknown_tool", f"unknown action {action.name!r}; actions: "
                                 f"{', '.join(self.action_names)}")
        if action.args:
            return error_outcome("bad_arguments", f"{action.name} takes no arguments")
        env = self._env(str(world["task_id"]))
        if self.codec is not None:
            key = self.codec.rng_key
            self.codec.write(env, {**world["gym"], **({key: world["rng"]} if key else {})})
        obs, reward, terminated, truncated, _ = env.step(self.action_names.index(action.name))
        total = float(world["return"]) + float(reward)
        new = {**world, **self._read(env), "obs": _jsonable(env, obs), "return": total,
               "last_reward": float(reward), "terminated": bool(terminated)}
        end = None
        if terminated:
            end = (Termination.ENV_TERMINAL_SUCCESS if total > 0
                   else Termination.ENV_TERMINAL_FAILURE)
        elif truncated:
            end = Termination.MAX_STEP_TRUNCATION
        text = f"{self._render(env, obs)}\nreward {float(reward):g}"
        return Outcome(text, world=new, end=end, final_action=action.name if end else None)

    def _read(self, env: Any) -> dict[str, Any]:
        """``{"gym": state without the RNG, "rng": the RNG}`` (both None without a codec)."""
        if self.codec is None:
            return {"gym": None, "rng": None}
        state = self.codec.read(env)
        rng = state.pop(self.codec.rng_key, None) if self.codec.rng_key else None
        return {"gym": state, "rng": rng}


def _jsonable(env: Any, obs: Any) -> Any:
    value = env.observation_space.to_jsonable([obs])[0]
    return int(value) if isinstance(value, int) else value


def task_lookup(tasks: Mapping[str, GymTask]) -> Callable[[str], GymTask]:
    """A task source over a fixed mapping (``TaskError`` for an unknown id)."""
    def lookup(task_id: str) -> GymTask:
        task = tasks.get(task_id)
        if task is None:
            raise TaskError(f"unknown gym task {task_id!r}")
        return task
    return lookup
