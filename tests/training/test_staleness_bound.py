"""The trainer's hard staleness bound: no action token older than ``max_version_lag`` reaches
an update (``StaleTokenError`` names the episode); the token count per lag is what the update
record reports."""

from __future__ import annotations

import pytest

from closedloop.contracts import Episode
from closedloop.errors import StaleTokenError
from closedloop.training.rl_step import require_within_lag
from tests.factories import make_traj, make_turn


def episode(eid: str, versions: list[str]) -> Episode:
    turns = tuple(make_turn(turn=i, version=v, action=(4, 5, 6)[: i + 1])
                  for i, v in enumerate(versions))
    return Episode(make_traj(episode_id=eid, num_turns=len(turns)), turns)


def test_tokens_within_the_bound_are_counted_by_lag() -> None:
    eps = [episode("a", ["v0002", "v0002"]), episode("b", ["v0003"])]
    assert require_within_lag(eps, train_version=3, max_version_lag=1) == {"0": 1, "1": 3}


@pytest.mark.parametrize(("versions", "lag"), [(["v0001"], 1), (["v0003", "v0001"], 1),
                                              (["v0004"], 3), (["v0002"], 0)])
def test_a_token_past_the_bound_or_from_the_future_stops_the_update(versions: list[str],
                                                                    lag: int) -> None:
    with pytest.raises(StaleTokenError, match="sampled by"):
        require_within_lag([episode("late", versions)], train_version=3, max_version_lag=lag)
