"""Any ``AgentEnv`` as a ``gymnasium.Env``: text in, text out, the verifier's reward at the end.

``AgentGymEnv`` takes an environment package (``closedloop.envs.discovery.EnvPackage``, by id or
as a record) or the three parts directly (an env factory, task ids and a ``TaskVerifier``).

- Spaces: observations and actions are ``gymnasium.spaces.Text`` over ``CHARSET`` (printable
  ASCII, tab, newline and U+FFFD). An observation is fitted to the space: characters outside the
  charset become U+FFFD and text past ``max_observation_chars`` is cut; ``info["observation"]``
  always holds the untouched text. An action is model text (``<tool_call>...</tool_call>``),
  parsed by the wrapped env.
- ``reset(seed=..., options=...)``: seeds ``self.np_random`` (``super().reset``), then picks the
  task (``options["task_id"]``, else a uniform draw from the task ids) and the env seed
  (``options["env_seed"]``, else a draw), and resets the wrapped env.
- ``step(text)`` returns ``(obs, reward, terminated, truncated, info)`` with the two ends kept
  apart: ``terminated`` when the wrapped env ends the episode with a terminal code (the agent
  finished, the env reached its end, the task budget ran out); ``truncated`` when the episode
  is cut without a verdict: ``max_turns`` reached here (the collector's limit, not the task's)
  or a censored code from the env (timeout, infrastructure). ``reward`` is 0.0 on every step
  but the terminating one, where it is the verifier's ``reward[reward_key]`` from the exported
  state; a truncated or quarantined episode has reward 0.0 and ``info["scored"] = False``
  (Gymnasium needs a float: the flag says the 0.0 is no score).
- ``render()`` (``render_mode="ansi"``) returns the last fitted observation.

``register(env_id)`` registers ``closedloop/<env_id>`` with Gymnasium, so ``gymnasium.make``
(and Gymnasium's checker, which re-makes the env per render mode) can build it.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium
from gymnasium import spaces

from closedloop.contracts import AgentEnv, Termination
from closedloop.errors import EnvError

CHARSET = frozenset(string.printable) - frozenset("\x0b\x0c\r") | {"\ufffd"}
MAX_OBSERVATION_CHARS = 16384
MAX_ACTION_CHARS = 4096


def fit_text(text: str, limit: int) -> str:
    """``text`` inside the Text space: unknown characters to U+FFFD, cut at ``limit``."""
    return "".join(c if c in CHARSET else "\ufffd" for c in text[:limit])


class AgentGymEnv(gymnasium.Env[str, str]):
    """An ``AgentEnv`` behind Gymnasium's API (see the module docstring)."""

    metadata = {"render_modes": ["ansi"], "render_fps": 1}  # noqa: RUF012 - gymnasium's name

    def __init__(self, env_id: str | None = None, *, package: Any = None,
                 make_env: Callable[[], AgentEnv] | None = None,
                 task_ids: Sequence[str] | None = None, verifier: Any = None,
                 split: str = "train", n_tasks: int = 8, max_turns: int | None = None,
                 reward_key: str = "task_success", render_mode: str | None = None,
                 max_observation_chars: int = MAX_OBSERVATION_CHARS) -> None:
        if env_id is not None or package is not None:
            package = package or _resolve(str(env_id))
            make_env = make_env or package.make_env
            verifier = verifier or package.verifier()
            task_ids = task_ids or _task_ids(package, split, n_tasks)
        if make_env is None or verifier is None or not task_ids:
            raise EnvError("AgentGymEnv needs an env id or package, or make_env, task_ids and "
                           "verifier")
        if render_mode not in (None, "ansi"):
            raise EnvError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.render_mode = render_mode
        self._make_env, self._verifier = make_env, verifier
        self.task_ids = tuple(task_ids)
        self.max_turns, self.reward_key = max_turns, reward_key
        self._limit = max_observation_chars
        self.observation_space = spaces.Text(max_observation_chars, min_length=0,
                                             charset=frozenset(CHARSET))
        self.action_space = spaces.Text(MAX_ACTION_CHARS, min_length=0,
                                        charset=frozenset(CHARSET))
        self.env: AgentEnv | None = None
        self._task_id: str | None = None
        self._env_seed = 0
        self._turns = 0
        self._last = ""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[str, dict[str, Any]]:
        """Seed, pick the task and env seed, reset the wrapped env (see the module docstring)."""
        super().reset(seed=seed)
        options = options or {}
        task_id = options.get("task_id")
        if task_id is None:
            task_id = self.task_ids[int(self.np_random.integers(len(self.task_ids)))]
        env_seed = options.get("env_seed")
        if env_seed is None:
            env_seed = int(self.np_random.integers(0, 2**31 - 1))
        self.env = self._make_env()
        text = self.env.reset(str(task_id), int(env_seed))
        self._task_id, self._env_seed, self._turns = str(task_id), int(env_seed), 0
        self._last = fit_text(text, self._limit)
        return self._last, {"task_id": self._task_id, "env_seed": self._env_seed,
                            "observation": text}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """One turn of the wrapped env (see the module docstring for the 5-tuple)."""
        if self.env is None or self._task_id is None:
            raise EnvError("call reset() before step()")
        tr = self.env.step(action)
        self._turns += 1
        terminated = tr.done and tr.termination is not None and tr.termination.is_terminal
        truncated = (tr.done and not terminated) or (
            not tr.done and self.max_turns is not None and self._turns >= self.max_turns)
        termination = tr.termination if tr.done else (
            Termination.MAX_STEP_TRUNCATION if truncated else None)
        info: dict[str, Any] = {"task_id": self._task_id, "env_seed": self._env_seed,
                                "observation": tr.observation, "error": tr.error,
                                "step_index": tr.step_index, "state_hash": tr.state_version,
                                "termination": None if termination is None else
                                termination.value, "scored": False}
        reward = 0.0
        if terminated:
            result = self._verifier.score_or_quarantine(self._task_id, self.env.export_state())
            info["quarantine_reason"] = result.quarantine_reason
            info["reward_components"] = None if result.reward is None else dict(result.reward)
            if result.reward is not None:
                reward = float(result.reward.get(self.reward_key, 0.0))
                info["scored"] = True
        self._last = fit_text(tr.observation, self._limit)
        return self._last, reward, bool(terminated), bool(truncated), info

    def render(self) -> str | None:
        """The last observation (``ansi``), or ``None`` without a render mode."""
        return self._last if self.render_mode == "ansi" else None


def _resolve(env_id: str) -> Any:
    from closedloop.envs.discovery import resolve_package

    return resolve_package(env_id)


def _task_ids(package: Any, split: str, n: int) -> tuple[str, ...]:
    from closedloop.contracts.package import TaskSetRequest

    sets = package.task_sets(TaskSetRequest(n if split == "train" else 1,
                                            n if split == "heldout" else 1))
    ids: tuple[str, ...] = sets.train if split == "train" else sets.heldout
    return ids


def register(env_id: str, **kwargs: Any) -> str:
    """Register ``closedloop/<env_id>`` with Gymnasium (idempotent); return the gym id."""
    gym_id = f"closedloop/{env_id}"
    if gym_id not in gymnasium.registry:
        gymnasium.register(gym_id, entry_point=f"{__name__}:AgentGymEnv",
                           kwargs={"env_id": env_id, **kwargs}, disable_env_checker=True)
    return gym_id
