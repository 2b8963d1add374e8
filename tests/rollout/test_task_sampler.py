"""Difficulty-band task sampler: streams, propensities, determinism, informative groups."""

from __future__ import annotations

import json
import math
import random

import pytest

from closedloop.evaluate.stats import wilson_interval
from closedloop.rollout.task_sampler import (
    DifficultyBandSampler,
    NoCandidateTasksError,
    TaskSamplerError,
    UnknownSamplerTaskError,
    p_zero_variance_estimate,
    wilson_bounds,
)

IDS = [f"t{i}" for i in range(10)]
FAMS = ["fa"] * 5 + ["fb"] * 5


def hand_built() -> DifficultyBandSampler:
    """t0 0/16 hard; t1 1/40 hard (rare success); t2 16/16 mastered; t3 0/8, t4 8/8, t5 4/8
    learnable; t6..t8 unknown (learnable); t9 quarantined by hand."""
    s = DifficultyBandSampler(IDS, FAMS, seed=7)
    for task, succ, n in [("t0", 0, 8), ("t0", 0, 8), ("t1", 1, 8), *[("t1", 0, 8)] * 4,
                          ("t2", 8, 8), ("t2", 8, 8), ("t3", 0, 8), ("t4", 8, 8), ("t5", 4, 8)]:
        s.update(task, succ, n)
    s.quarantine("t9", "verifier under audit")
    return s


def test_wilson_bounds_match_the_evaluate_statistics():
    for n in (1, 5, 8, 16, 40):
        for k in range(n + 1):
            assert wilson_bounds(k, n, 1.96) == pytest.approx(wilson_interval(k, n), abs=1e-12)
    # hand-worked band edges: 0/8 -> hi 0.3244, 0/16 -> hi 0.1936, 16/16 -> lo 0.8064
    assert wilson_bounds(0, 8, 1.96)[1] == pytest.approx(3.8416 / 11.8416, abs=1e-4)
    assert wilson_bounds(0, 16, 1.96)[1] == pytest.approx(0.1936, abs=1e-4)
    assert wilson_bounds(16, 16, 1.96)[0] == pytest.approx(0.8064, abs=1e-4)
    assert wilson_bounds(0, 0, 1.96) == (0.0, 1.0)


def test_streams_on_hand_built_counts():
    s = hand_built()
    streams = s.streams()
    assert streams == {"learnable": ("t3", "t4", "t5", "t6", "t7", "t8"), "hard": ("t0", "t1"),
                       "mastered": ("t2",), "quarantined": ("t9",)}
    assert s.estimate("t1").rare_successes and not s.estimate("t0").rare_successes
    assert s.estimate("t6").p_hat is None and s.estimate("t5").p_hat == 0.5
    assert s.estimate("t9").quarantine_reason == "verifier under audit"


def test_streams_move_with_evidence_and_quarantine_rules():
    s = DifficultyBandSampler(IDS, FAMS, seed=0, max_failures=3)
    s.update("t0", 8, 8)
    assert s.stream_of()["t0"] == "learnable"         # one lucky group does not move it
    s.update("t0", 8, 8)
    assert s.stream_of()["t0"] == "mastered"
    s.update("t0", 0, 8)
    s.update("t0", 2, 8)
    assert s.stream_of()["t0"] == "learnable"         # forgetting brings it back
    s.record_failure("t1", "infra_abort")
    s.record_failure("t1", "tamper_detected")
    assert s.stream_of()["t1"] == "learnable"
    s.record_failure("t1", "infra_abort")
    assert s.stream_of()["t1"] == "quarantined"
    assert "3 environment/verifier failures" in (s.estimate("t1").quarantine_reason or "")
    s.release("t1")
    assert s.stream_of()["t1"] == "learnable" and s.counts("t1").failures == 0


def test_propensities_hand_worked_and_sum_to_one():
    s = hand_built()
    p = s.propensities()
    assert sum(p.values()) == pytest.approx(1.0, abs=1e-12)
    for t in ("t3", "t4", "t5", "t6", "t7", "t8"):
        assert p[t] == pytest.approx(0.7 / 6)
    assert p["t0"] == p["t1"] == pytest.approx(0.15 / 2)
    assert p["t2"] == pytest.approx(0.15)
    assert p["t9"] == 0.0
    fresh = DifficultyBandSampler(IDS, FAMS, seed=0)           # only learnable: uniform
    assert list(fresh.propensities().values()) == pytest.approx([0.1] * 10)
    no_mastered = DifficultyBandSampler(IDS, FAMS, seed=0)
    no_mastered.update("t0", 0, 16)                             # hard + learnable: renormalize
    q = no_mastered.propensities()
    assert q["t0"] == pytest.approx(0.15 / 0.85) and q["t1"] == pytest.approx(0.7 / 0.85 / 9)


def test_draw_frequencies_match_propensities():
    s = hand_built()
    p = s.propensities()
    counts = dict.fromkeys(IDS, 0)
    total = 0
    for step in range(400):
        for d in s.sample(50, step):
            counts[d.task_id] += 1
            total += 1
    assert total == 20_000 and counts["t9"] == 0
    for t in IDS:
        se = math.sqrt(p[t] * (1 - p[t]) / total)
        assert abs(counts[t] / total - p[t]) <= 4 * se + 1e-12, t


def test_draws_carry_family_stream_propensity_and_are_deterministic():
    s = hand_built()
    draws = s.sample(12, step=3)
    assert draws == hand_built().sample(12, step=3)
    assert draws != s.sample(12, step=4)
    assert [d.index for d in draws] == list(range(12))
    p, stream = s.propensities(), s.stream_of()
    for d in draws:
        assert (d.step, d.family, d.stream, d.propensity) == \
            (3, s.family_of[d.task_id], stream[d.task_id], p[d.task_id])
    assert DifficultyBandSampler(IDS, FAMS, seed=8).sample(12, 3) != \
        DifficultyBandSampler(IDS, FAMS, seed=7).sample(12, 3)


def test_state_round_trips_through_json():
    s = hand_built()
    s.record_failure("t3", "infra_abort")
    data = json.loads(json.dumps(s.to_dict(group_size=8)))
    back = DifficultyBandSampler.from_dict(data)
    assert back.to_dict(group_size=8) == s.to_dict(group_size=8)
    assert back.sample(20, 5) == s.sample(20, 5)
    assert data["streams"] == {"learnable": 6, "hard": 2, "mastered": 1, "quarantined": 1}
    assert data["family_share"] == {"fa": 0.5, "fb": 0.5}
    # fa = t0, t1 (hard), t2 (mastered), t3, t4 (learnable)
    assert data["family_propensity"]["fa"] == pytest.approx(2 * 0.15 / 2 + 0.15 + 2 * 0.7 / 6)


def test_zero_variance_estimator_hand_worked():
    assert p_zero_variance_estimate(2, 4, 2) == pytest.approx(2 / 6)   # [C(2,2)+C(2,2)]/C(4,2)
    assert p_zero_variance_estimate(0, 0, 8) == pytest.approx(2 * 0.5**8)
    assert p_zero_variance_estimate(3, 3, 8) == pytest.approx(0.8**8 + 0.2**8)  # p~ = 4/5
    assert p_zero_variance_estimate(0, 16, 8) == 1.0


def test_predicted_zero_variance_rate_matches_observed_in_simulation():
    from closedloop.learn.credit import p_zero_variance

    true_p = {"t0": 0.02, "t1": 0.1, "t2": 0.3, "t3": 0.5, "t4": 0.7, "t5": 0.97}
    G = 8
    s = DifficultyBandSampler(list(true_p), ["f"] * 6, seed=1)
    rng = random.Random(123)
    truth = 0.0
    for step in range(150):
        for d in s.sample(6, step):
            truth += p_zero_variance(true_p[d.task_id], G)
            s.update(d.task_id, sum(rng.random() < true_p[d.task_id] for _ in range(G)), G)
    stats = s.informative_stats(G)
    assert stats.groups == 900
    truth /= stats.groups
    se = math.sqrt(truth * (1 - truth) / stats.groups)
    assert stats.observed_rate is not None and stats.predicted_rate is not None
    assert abs(stats.observed_rate - truth) < 4 * se
    assert abs(stats.predicted_rate - truth) < 0.03
    lo, hi = stats.observed_ci or (0.0, 0.0)
    assert lo <= stats.observed_rate <= hi
    props = s.propensities()
    next_truth = sum(props[t] * p_zero_variance(p, G) for t, p in true_p.items())
    assert stats.predicted_next_rate == pytest.approx(next_truth, abs=0.03)
    assert stats.predicted_next_informative == pytest.approx(1 - stats.predicted_next_rate)


def test_named_errors():
    with pytest.raises(TaskSamplerError):
        DifficultyBandSampler(IDS, FAMS, seed=0, band=(0.8, 0.2))
    with pytest.raises(TaskSamplerError):
        DifficultyBandSampler(IDS, FAMS, seed=0, stream_weights={"learnable": 1, "easy": 1})
    with pytest.raises(TaskSamplerError):
        DifficultyBandSampler(IDS, FAMS[:3], seed=0)
    with pytest.raises(TaskSamplerError):
        DifficultyBandSampler(["a", "a"], ["f", "f"], seed=0)
    s = DifficultyBandSampler(IDS, dict(zip(IDS, FAMS, strict=True)), seed=0)
    with pytest.raises(TaskSamplerError):
        s.update("t0", 5, 4)
    with pytest.raises(TaskSamplerError):
        s.update("t0", 0, 0)
    with pytest.raises(UnknownSamplerTaskError):
        s.update("nope", 1, 2)
    for t in IDS:
        s.quarantine(t, "broken env")
    with pytest.raises(NoCandidateTasksError):
        s.sample(1, 0)
