"""Gymnasium, both ways: any ``AgentEnv`` as a ``gymnasium.Env`` (``AgentGymEnv``), and a
Gymnasium env with a text rendering as an ``AgentEnv`` (``GymRules`` under ``SimEnv``), with
FrozenLake as the shipped example package ``frozenlake-v1``.
"""

from closedloop.envs.gym_bridge.as_gym import CHARSET, AgentGymEnv, fit_text, register
from closedloop.envs.gym_bridge.from_gym import TOY_TEXT_CODEC, GymRules, GymTask, StateCodec
from closedloop.errors import GymAdapterError

__all__ = ["CHARSET", "TOY_TEXT_CODEC", "AgentGymEnv", "GymAdapterError", "GymRules", "GymTask",
           "StateCodec", "fit_text", "register"]
