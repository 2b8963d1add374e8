"""The recurrent actor–critic through closedloop's contracts, quick: both arms of a few hundred
key-and-door episodes end to end (traces, versions, behaviour log-probs against the trainer's,
termination codes, the verifier, greedy evaluation per exit colour, the shaped run's boundary
check), the report and its plot. Learning itself is the full command's claim, not this test's."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from matplotlib.image import imread

from closedloop.contracts import load_episodes
from closedloop.experiments.recurrent_ac_report import QUICK, run_both
from closedloop.learn.ac_update import ACConfig, ac_loss, turn_batch
from tests.learn.keydoor_traces import collect_keydoor, feature_policy, keydoor, keydoor_tasks


def test_the_first_pass_scores_exactly_what_the_behaviour_policy_sampled() -> None:
    model = feature_policy(seed=7)
    train, _ = keydoor_tasks(6, 2)
    episodes = collect_keydoor(model, train, group_size=4)
    codec = keydoor().feature_codec
    assert codec is not None
    out = ac_loss(model, turn_batch(episodes, codec), ACConfig())
    assert out.ratio_max == pytest.approx(1.0, abs=1e-5)  # trainer log π = recorded π_beh
    assert math.isfinite(float(out.loss.detach())) and out.entropy > 0
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_both_arms_run_through_the_contracts_and_report(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    cfg = replace(QUICK, iterations=3, eval_every=3, trace_every=2)
    report = run_both(cfg, tmp_path, parallel=False)
    assert set(report["arms"]) == {"sparse", "shaped"}
    for name in ("sparse", "shaped"):
        arm = tmp_path / name
        records = [json.loads(x) for x in (arm / "metrics.jsonl").read_text().splitlines()]
        iters = [r for r in records if r["kind"] == "iteration"]
        assert [r["policy_version"] for r in iters] == ["v0000", "v0001", "v0002"]
        assert all(r["ratio_max"] == pytest.approx(1.0, abs=1e-4) for r in iters)
        evals = [r for r in records if r["kind"] == "eval"]
        assert [e["iteration"] for e in evals] == [0, 3]
        assert {"red", "blue"} <= set(evals[-1]["train"]) and evals[-1]["train"]["n"] == 8
        # the traces of iterations 0 and 2, and every evaluation, read back as episodes
        _, episodes = load_episodes(arm / "traces" / "iter-0002.jsonl")
        assert len(episodes) == 8 * 4
        assert {e.trajectory.behavior_policy_version for e in episodes} == {"v0002"}
        assert all(e.trajectory.termination.is_terminal for e in episodes)  # budget < turns
        assert all(e.trajectory.reward is not None for e in episodes)  # the verifier scored
        _, greedy = load_episodes(arm / "traces" / "eval-heldout-0003.jsonl")
        assert all(t.behavior_logprobs == [0.0] for e in greedy for t in e.turns)
        assert (arm / "model.pt").is_file()
    shaped = report["arms"]["shaped"]
    assert shaped["boundary_max_dev"] is not None and shaped["boundary_max_dev"] < 1e-9
    assert report["arms"]["sparse"]["boundary_max_dev"] is None
    image = imread(tmp_path / "keydoor_ac.png")
    assert image.shape[0] > 200 and image.shape[1] > 500
