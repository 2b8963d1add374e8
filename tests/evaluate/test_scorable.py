"""A run that cannot produce a scored episode stops, naming the config keys that decide it
(closedloop.evaluate.scorable): every episode of a step cut at the turn limit, at the action
token limit, cancelled past its deadline, or quarantined."""

from __future__ import annotations

import dataclasses

import pytest

from closedloop.contracts import Termination
from closedloop.errors import UnscorableRunError
from closedloop.evaluate.scorable import require_scored
from tests.factories import make_traj

BUDGETS = {"environment.max_turns": 4, "rollout.max_action_tokens": 64,
           "credit.censor_rule": "discard_group"}


def _trajs(*codes: Termination) -> list:
    return [make_traj(termination=c, episode_id=f"e{i}") for i, c in enumerate(codes)]


def test_one_scored_episode_is_enough() -> None:
    require_scored(_trajs(Termination.MAX_STEP_TRUNCATION, Termination.AGENT_FINISH),
                   "RL step 0", "discard_group", BUDGETS)
    require_scored([], "RL step 0", "discard_group", BUDGETS)  # nothing collected: not this


def test_every_episode_cut_at_the_turn_limit_names_max_turns() -> None:
    with pytest.raises(UnscorableRunError) as info:
        require_scored(_trajs(*[Termination.MAX_STEP_TRUNCATION] * 3,
                              Termination.MAX_TOKEN_TRUNCATION),
                       "RL step 0", "discard_group", BUDGETS)
    err = info.value
    assert err.keys == ["environment.max_turns", "rollout.max_action_tokens",
                        "credit.censor_rule"]
    assert err.terminations == {"max_step_truncation": 3, "max_token_truncation": 1}
    assert "environment.max_turns = 4: raise it to at least the package's step budget" in \
        str(err) and "RL step 0" in str(err)


def test_cancelled_and_quarantined_episodes_name_their_cause() -> None:
    with pytest.raises(UnscorableRunError) as info:
        require_scored(_trajs(Termination.SCHEDULER_CANCEL), "RL step 2", "drop_censored",
                       BUDGETS)
    assert info.value.keys == ["rollout.episode_deadline_s"]
    quarantined = [dataclasses.replace(make_traj(termination=Termination.AGENT_FINISH),
                                       reward=None, quarantine_reason="tamper_detected: x")]
    with pytest.raises(UnscorableRunError, match="closedloop check") as info:
        require_scored(quarantined, "RL step 0", "drop_censored", BUDGETS)
    assert info.value.terminations == {"agent_finish": 1, "quarantined": 1}
