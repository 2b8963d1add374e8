"""Crash test of an asynchronous run (``rollout.mode: async``, lag 1): SIGKILL ``closedloop
train`` while the generator's rounds wait in the admission queue, resume, compare with an
uninterrupted run.

The machinery is ``tests.test_crash_resume``'s (one launch per kill, the whole process group
killed; each launch, the reference's too, forked from the kill bed's zygote,
``tests.conftest.kill_bed``, so a relaunch costs the model load, not the imports), with a plan
in the async timeline's order: under async at lag 1 the generator commits round k's trace while
the trainer is still on step k - 1, so an ``update`` kill at k (fired when round k's trace
appears) lands with round k buffered in the queue; a ``collect`` kill lands in a partial round,
``checkpoint`` and ``commit`` kills around the trainer's commit point.

Then, against the reference: every group consumed exactly once (none lost, none replayed:
the same groups, the same sampled actions), the ledger's fates and steps equal, the final
adapter and optimizer state bit-identical, and no round ever started before the version the
schedule gives it was staged (the generator was not let run ahead after a resume).
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from closedloop.contracts import load_episodes
from closedloop.rollout.ledger import Ledger
from tests.conftest import short_run_config
from tests.forked_launch import KillBed
from tests.test_crash_resume import (
    RL_STEPS,
    Kill,
    child_env,
    final_checkpoint,
    flat_tensors,
    leaves_equal,
    run_with_kills,
    step_actions,
    tail,
)

# two 3-step runs, one killed up to 4 times; the kill bed's zygote forks every launch
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("kill-bed")]

LAG = 1
DEADLINE_S = 900.0


def async_config(model_dir: Path) -> dict[str, Any]:
    data = short_run_config(model_dir, RL_STEPS)
    data["rollout"] = {**data["rollout"], "mode": "async",  # type: ignore[dict-item]
                       "max_version_lag": LAG}
    data["update"] = {"objective": "ppo_clip", "proximal_policy": "trainer_at_step_start",
                      "reference_policy": "initial"}
    return data


def _started_after_their_version(run_dir: Path) -> list[str]:
    """Rounds whose first episode started before their scheduled version was staged."""
    early = []
    versions = run_dir / "registry" / "versions"
    for step in range(RL_STEPS):
        _, episodes = load_episodes(run_dir / "traces" / f"step-{step:04d}.jsonl")
        version = f"v{max(0, step - LAG):04d}"
        staged = (versions / version).stat().st_mtime
        first = min(datetime.fromisoformat(ep.trajectory.rollout_started_at).timestamp()
                    for ep in episodes)
        if first + 0.05 < staged:  # file times are coarser than the clock
            early.append(f"round {step} started {staged - first:.2f}s before {version}")
    return early


def test_an_async_run_killed_with_rounds_in_the_queue_resumes_to_the_same_weights(
        tiny_agent_dir: Path, kill_bed: KillBed, tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(async_config(tiny_agent_dir)))
    ref_dir, crash_dir = tmp_path / "reference", tmp_path / "crashed"
    deadline = time.monotonic() + DEADLINE_S
    reference = kill_bed.zygote.launch(config, ref_dir, tmp_path / "reference.log",
                                       child_env(checkpoint_pause_s=None))
    last = RL_STEPS - 1
    plan = [Kill("update", 1, 0.1), Kill("collect", last, 0.5), Kill("update", last, 0.05),
            Kill("commit", last, 0.0)]
    try:
        crashed = run_with_kills(config, crash_dir, tmp_path / "crashed.log", plan, deadline,
                                 launcher=kill_bed.zygote.launch)
        rc = reference.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if reference.poll() is None:
            os.killpg(reference.pid, signal.SIGKILL)
            reference.wait()
    assert rc == 0, f"reference run failed:\n{tail(tmp_path / 'reference.log')}"
    landed = [k["landed"] for k in crashed.kills]
    print(json.dumps({"launches": crashed.launches, "landed": landed,
                      "skipped": [str(k) for k in crashed.skipped]}, indent=1))
    assert len(crashed.kills) >= 3, landed
    queued = [k for k in crashed.kills if k["planned"].phase == "update"]
    assert queued, "no kill landed while a round waited in the queue"

    expected = {f"s{s:04d}-g{j}" for s in range(RL_STEPS) for j in range(2)}
    with Ledger(ref_dir / "ledger.sqlite") as ref, Ledger(crash_dir / "ledger.sqlite") as led:
        led.verify()
        states = {g: (led.get(g).state, led.get(g).consumed_step) for g in led.group_ids()}
        assert states == {g: (ref.get(g).state, ref.get(g).consumed_step)
                          for g in ref.group_ids()}
        assert set(states) == expected
        once = led.exactly_once_report(expected)
        assert once.ok and not once.duplicate and once.duplicate_attempts == 0, once.counts()
        assert not (once.lost or once.pending or once.unexpected), once.counts()
    assert step_actions(crash_dir) == step_actions(ref_dir), "a resumed round sampled otherwise"
    a, b = final_checkpoint(ref_dir), final_checkpoint(crash_dir)
    assert a.consumed_group_ids == b.consumed_group_ids
    assert all(torch.equal(v, b.model_state[k]) for k, v in a.model_state.items())
    ref_opt, crash_opt = dict(flat_tensors(a.optimizer_state)), dict(
        flat_tensors(b.optimizer_state))
    assert ref_opt.keys() == crash_opt.keys()
    assert all(leaves_equal(ref_opt[k], crash_opt[k]) for k in ref_opt)
    assert not _started_after_their_version(crash_dir)
    assert not _started_after_their_version(ref_dir)
