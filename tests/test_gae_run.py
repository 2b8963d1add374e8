"""credit.estimator: gae end to end on the tiny agent: the critic over the policy's hidden
states gives each turn its own advantage, painted onto that turn's action tokens only; the
critic is kept beside every checkpoint and a resumed run continues with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from closedloop.config import RunConfig, parse_config
from closedloop.contracts import load_episodes
from closedloop.errors import CheckpointError
from closedloop.learn.turn_credit import broadcast_turn_values, turn_table
from closedloop.rollout.tensors import build_training_batch
from closedloop.training.loop import train
from tests.conftest import short_run_config

pytestmark = pytest.mark.slow


def _cfg(model: Path, steps: int) -> RunConfig:
    data = short_run_config(model, steps)
    data["credit"].update({"estimator": "gae", "gae_lambda": 0.9})  # type: ignore[attr-defined]
    return parse_config(data)


def test_gae_trains_turn_credit_and_resumes_with_its_critic(tiny_agent_dir: Path,
                                                            tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    run = tmp_path / "run"
    try:
        train(_cfg(tiny_agent_dir, 1), run)
        steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()
                 if json.loads(x)["kind"] == "rl_step"]
        (step,) = steps
        assert step["credit"]["estimator"] == "gae" and step["credit"]["lambda"] == 0.9
        assert step["credit"]["value_loss"] >= 0 and "critic_s" in step["seconds"]
        assert step["metrics"]["batch/n_episodes"] > 0
        assert {p.name for p in (run / "critic").iterdir()} == {"step-000000.pt",
                                                                "step-000001.pt"}
        # a resumed run loads the critic of its checkpoint's step and trains on
        train(_cfg(tiny_agent_dir, 2), run, config_override="one more step")
        assert (run / "critic" / "step-000002.pt").is_file()
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(CheckpointError) as err:  # a checkpoint step without its critic
        (run / "critic" / "step-000002.pt").unlink()
        train(_cfg(tiny_agent_dir, 2), run, config_override="one more step")
    assert "step-000002.pt" in str(err.value)

    # the painting: a turn's advantage on its own action tokens, 0 on prompts and padding
    _, episodes = load_episodes(run / "traces" / "step-0000.jsonl")
    turn_adv = [[0.5 + k for k in range(len(ep.turns))] for ep in episodes]
    batch = build_training_batch(list(episodes))
    token_adv = broadcast_turn_values(turn_table(turn_adv), batch.turn_ids_B_T,
                                      batch.action_mask_B_T)
    assert token_adv.shape == batch.token_ids_B_T.shape
    on = batch.action_mask_B_T > 0
    torch.testing.assert_close(token_adv[on], (batch.turn_ids_B_T[on] + 0.5).float())
    assert bool((token_adv[~on] == 0).all())
