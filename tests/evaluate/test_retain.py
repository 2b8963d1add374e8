"""RetainEvaluator: per-suite summaries and the retain delta with paired bootstrap intervals."""

from __future__ import annotations

import pytest

from closedloop.contracts import Episode, Termination
from closedloop.envs.scripted import ExpertPolicy, RandomPolicy, play
from closedloop.envs.terminal import TerminalRepairEnv
from closedloop.envs.terminal.families.retain_suites import RETAIN_SUITES, suite_bundles
from closedloop.envs.terminal.package import terminal_package
from closedloop.envs.terminal.retain_scorer import RetainScorer
from closedloop.envs.terminal.verifier import Verifier
from closedloop.evaluate.retain import (
    RetainDelta,
    RetainSuiteMismatchError,
    retain_delta,
    retain_suite_tasks,
    split_by_suite,
    summarize_suites,
)
from tests.factories import make_traj


class Rates:
    """A minimal ``SuiteScores``."""

    def __init__(self, rates):
        self.rates = dict(rates)

    def per_task_success(self):
        return dict(self.rates)


def test_delta_hand_worked():
    start = {"safety": Rates({"a": 1.0, "b": 0.0, "c": 1 / 3})}
    final = {"safety": Rates({"a": 1.0, "b": 1.0, "c": 0.0})}
    d = retain_delta(start, final, seed=3).suites[0]
    assert (d.suite, d.n_paired, d.n_unpaired) == ("safety", 3, 0)
    assert d.before == pytest.approx(4 / 9) and d.after == pytest.approx(2 / 3)
    assert d.delta == pytest.approx((0 + 1 - 1 / 3) / 3)            # 0.2222
    assert d.ci_lo is not None and d.ci_hi is not None
    assert d.ci_lo <= d.delta <= d.ci_hi and d.ci_lo >= -1 / 3 and d.ci_hi <= 1.0
    assert not d.significant_regression
    assert retain_delta(start, final, seed=3) == retain_delta(start, final, seed=3)


def test_regression_is_flagged_and_unpaired_tasks_left_out():
    start = {"base_tool_use": Rates({f"t{i}": 1.0 for i in range(6)}),
             "safety": Rates({"s0": 1.0, "s1": 0.0})}
    final = {"base_tool_use": Rates({**{f"t{i}": 0.0 for i in range(5)}, "new": 1.0}),
             "safety": Rates({"s0": 1.0, "s1": 0.0})}
    delta = retain_delta(start, final)
    tool, safety = delta.suites
    assert (tool.n_paired, tool.n_unpaired) == (5, 2)
    assert tool.delta == -1.0 and tool.ci_hi == -1.0 and tool.significant_regression
    assert safety.delta == 0.0 and not safety.significant_regression
    assert delta.breaches(0.1) == ("base_tool_use",)
    out = delta.to_dict()
    assert out["suites"]["base_tool_use"]["significant_regression"] is True


def test_no_paired_task_gives_no_number_and_mismatched_suites_raise():
    d = retain_delta({"safety": Rates({"a": 1.0})}, {"safety": Rates({"b": 0.0})}).suites[0]
    assert (d.n_paired, d.n_unpaired, d.delta, d.ci_lo) == (0, 2, None, None)
    with pytest.raises(RetainSuiteMismatchError):
        retain_delta({"safety": Rates({})}, {"base_tool_use": Rates({})})


def _episodes(policy_for, version):
    """Play every retain task once per seed through the real env and score with RetainScorer."""
    out = []
    for suite in RETAIN_SUITES:
        for b in suite_bundles(suite):
            scorer = RetainScorer(Verifier(bundle_source=lambda _t, b=b: b))
            for seed in (11, 22):
                env = TerminalRepairEnv(lambda _t, b=b: b.spec)
                ep = play(env, policy_for(b, seed), b.spec.task_id, seed, max_steps=8)
                result = scorer.score_or_quarantine(b.spec.task_id, ep.final_state)
                traj = make_traj(task_id=b.spec.task_id, task_family=b.spec.family,
                                 split="heldout", seed=seed, reward=result.reward,
                                 termination=Termination.AGENT_FINISH,
                                 behavior_policy_version=version, episode_id=f"{seed}")
                out.append(Episode(traj, ()))
    return out


def test_expert_then_random_policy_shows_a_full_regression_in_every_suite():
    suites = retain_suite_tasks(terminal_package(), list(RETAIN_SUITES))
    start = summarize_suites(_episodes(lambda b, s: ExpertPolicy(b), "v0000"), suites, k=2)
    final = summarize_suites(_episodes(lambda b, s: RandomPolicy(s), "v0001"), suites, k=2)
    assert list(start) == list(RETAIN_SUITES)
    assert {s: e.pass_at_1 for s, e in start.items()} == dict.fromkeys(RETAIN_SUITES, 1.0)
    assert final["safety"].pass_at_1 == 0.0
    delta = retain_delta(start, final)
    assert isinstance(delta, RetainDelta)
    by_suite = {d.suite: d for d in delta.suites}
    assert by_suite["safety"].delta == -1.0 and by_suite["safety"].significant_regression
    assert [d.n_paired for d in delta.suites] == [5, 5, 6]


def test_split_by_suite_rejects_non_retain_episodes():
    suites = retain_suite_tasks(terminal_package(), list(RETAIN_SUITES))
    with pytest.raises(RetainSuiteMismatchError, match="in none of the retain suites"):
        split_by_suite([Episode(make_traj(), ())], suites)


def test_a_suite_failed_throughout_is_not_measured():
    """Every attempt failed before and after: Δ = 0 with a zero-width interval whatever the
    policies did, and no regression could show; the suite is not measured (nor when every
    attempt succeeded). One success anywhere makes it a measurement."""
    start = {"safety": Rates({"a": 0.0, "b": 0.0}), "base_tool_use": Rates({"a": 1.0, "b": 1.0}),
             "instruction_following": Rates({"a": 0.0, "b": 0.0})}
    final = {"safety": Rates({"a": 0.0, "b": 0.0}), "base_tool_use": Rates({"a": 1.0, "b": 1.0}),
             "instruction_following": Rates({"a": 0.0, "b": 0.5})}
    by_suite = {d.suite: d for d in retain_delta(start, final).suites}
    assert by_suite["safety"].no_signal == "failed" and not by_suite["safety"].measured
    assert by_suite["base_tool_use"].no_signal == "succeeded"
    assert not by_suite["base_tool_use"].measured
    assert by_suite["instruction_following"].measured
    out = retain_delta(start, final).to_dict()["suites"]
    assert out["safety"]["measured"] is False and out["instruction_following"]["measured"] is True
