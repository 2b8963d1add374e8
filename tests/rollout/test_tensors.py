"""Training tensors from traces, and the one next-token shift (seed 004 exercise 6)."""

import pytest
import torch

from closedloop.contracts import ContractError, Episode
from closedloop.rollout.tensors import build_training_batch, shift_targets
from tests.factories import make_traj, make_turn


def two_turn_episode(system=3, action1=2, observation=4, action2=2, episode_id="ep"):
    """SYSTEM=3, ASSISTANT=2, OBSERVATION=4, ASSISTANT=2 as two threaded turns."""
    t0 = make_turn(0, prompt=range(100, 100 + system), action=range(200, 200 + action1),
                   context_len=system, episode_id=episode_id)
    t1 = make_turn(1, prompt=range(300, 300 + observation), action=range(400, 400 + action2),
                   context_len=system + action1 + observation, episode_id=episode_id)
    return Episode(make_traj(num_turns=2, episode_id=episode_id), (t0, t1))


def test_seed_004_exercise_6_mask_shift():
    batch = build_training_batch([two_turn_episode()])
    mask = batch.action_mask_B_T[0]
    # hand-counted: 0 0 0 | 1 1 | 0 0 0 0 | 1 1
    assert mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1]
    assert mask.sum().item() == 4
    shifted = shift_targets(batch).mask_B_T[0]
    # position t predicts token t+1: 0 0 1 1 0 0 0 0 1 1
    assert shifted.tolist() == [0, 0, 1, 1, 0, 0, 0, 0, 1, 1]
    assert shifted.sum().item() == 4


def test_shifted_targets_are_the_action_ids_and_their_logprobs():
    ep = two_turn_episode()
    shifted = shift_targets(build_training_batch([ep]))
    live = shifted.mask_B_T[0].bool()
    assert shifted.target_ids_B_T[0][live].tolist() == [200, 201, 400, 401]
    assert shifted.behavior_logprobs_B_T[0][live].tolist() == [-0.5] * 4
    assert shifted.turn_ids_B_T[0][live].tolist() == [0, 0, 1, 1]
    assert (shifted.turn_ids_B_T[0][~live] == -1).all()


def test_mask_shifted_by_one_is_caught():
    """Mutation check: a mask shifted by one no longer selects the action ids."""
    shifted = shift_targets(build_training_batch([two_turn_episode()]))
    wrong = torch.roll(shifted.mask_B_T[0], 1).bool()
    assert shifted.target_ids_B_T[0][wrong].tolist() != [200, 201, 400, 401]


def test_padding_and_episode_ids():
    short = two_turn_episode(observation=1, episode_id="a")
    long = two_turn_episode(observation=6, episode_id="b")
    batch = build_training_batch([short, long], pad_id=7)
    assert batch.token_ids_B_T.shape == (2, 13)
    assert batch.attention_mask_B_T.sum(dim=1).tolist() == [8, 13]
    assert batch.token_ids_B_T[0, 8:].tolist() == [7] * 5
    assert batch.action_mask_B_T[0, 8:].sum() == 0
    assert batch.episode_ids == ("a", "b")


def test_threading_mismatch_rejected():
    t0 = make_turn(0)
    t1 = make_turn(1, prompt=(6, 7), action=(8,), context_len=99)
    with pytest.raises(ContractError, match="threaded context"):
        build_training_batch([Episode(make_traj(), (t0, t1))])
