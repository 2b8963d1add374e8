"""Admission gates: versions, manifests, hard staleness bound, drift, censoring, strata."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from closedloop.contracts import (
    ConfigError,
    ContractError,
    GroupLease,
    MixedPolicyGroupError,
    SamplerConfig,
    StalePolicyError,
    Termination,
    TrajectoryRecord,
    sha256_hex,
)
from closedloop.rollout.admission import (
    DISPOSITIONS,
    AdmissionController,
    AdmissionStats,
    apply_decision,
)
from closedloop.rollout.ledger import GroupSummary, Ledger
from tests.factories import SAMPLER, make_traj

H = sha256_hex("x")


def lease(version: str = "v0000", size: int = 4, **kw: Any) -> GroupLease:
    values: dict[str, Any] = dict(
        group_id="g", run_id="run", task_id="json-repair-v1/a/000-x", seed=11,
        base_snapshot_id="snap", behavior_manifest_hash=H, behavior_policy_version=version,
        sampler_config_hash=SAMPLER.config_hash(), group_size=size)
    values.update(kw)
    return GroupLease(**values)


def group(n: int = 4, version: str = "v0000", **kw: Any) -> list[TrajectoryRecord]:
    return [make_traj(episode_id=f"ep{i}", sample_index=i, behavior_policy_version=version, **kw)
            for i in range(n)]


def replace(members: list[TrajectoryRecord], i: int, **kw: Any) -> list[TrajectoryRecord]:
    out = list(members)
    values = {**members[i].__dict__, **kw}
    out[i] = TrajectoryRecord(**values)
    return out


def test_fresh_complete_group_is_admitted() -> None:
    d = AdmissionController().admit(group(), lease(), train_version_index=0)
    assert (d.admitted, d.disposition, d.reason, d.lag) == (True, "admit", None, 0)
    assert d.n_members == 4 and d.censored_episode_ids == ()


CENSORED = {"termination": Termination.TOOL_TIMEOUT}
REJECTIONS: dict[str, tuple[list[TrajectoryRecord], GroupLease, int, str]] = {
    "empty": ([], lease(), 0, "empty_group"),
    "other group": (replace(group(), 1, group_id="h"), lease(), 0, "group_mismatch"),
    "other seed": (replace(group(), 1, seed=12), lease(), 0, "group_mismatch"),
    "same episode twice": (replace(group(), 1, episode_id="ep0"), lease(), 0, "group_mismatch"),
    "oversized": (group(5), lease(), 0, "oversized_group"),
    "two versions": (replace(group(), 2, behavior_policy_version="v0001"), lease(), 1,
                     "mixed_policy_group"),
    "version not the lease's": (group(version="v0001"), lease(), 1, "mixed_policy_group"),
    "mixed-policy episode": (replace(group(), 3, mixed_policy=True), lease(), 0,
                             "mixed_policy_group"),
    "manifest": (replace(group(), 0, policy_manifest_hash=sha256_hex("y")), lease(), 0,
                 "manifest_mismatch"),
    "sampler": (replace(group(), 0, sampler_config=SamplerConfig(temperature=0.7)), lease(),
                0, "manifest_mismatch"),
    "tampered member": (replace(group(), 2, quarantine_reason="TamperDetected", reward=None),
                        lease(), 0, "member_quarantined"),
    "incomplete": (group(3), lease(), 0, "incomplete_group"),
    "future version": (group(version="v0002"), lease("v0002"), 1, "negative_lag"),
    "stale": (group(), lease(), 1, "stale_policy"),
    "bad version name": (group(version="latest"), lease("latest"), 0, "invalid_version"),
    "censored member": (replace(group(), 1, reward=None, **CENSORED), lease(), 0,
                        "censored_member"),
}


@pytest.mark.parametrize("name", list(REJECTIONS))
def test_each_gate_rejects_with_its_reason(name: str) -> None:
    members, the_lease, train, reason = REJECTIONS[name]
    d = AdmissionController().admit(members, the_lease, train_version_index=train)
    assert (d.admitted, d.reason, d.disposition) == (False, reason, DISPOSITIONS[reason])
    assert d.detail


def test_lag_is_a_hard_bound() -> None:
    ctl = AdmissionController(max_version_lag=1)
    assert ctl.admit(group(), lease(), 1).admitted
    d = ctl.admit(group(), lease(), 2)
    assert (d.admitted, d.reason, d.lag) == (False, "stale_policy", 2)


@given(behavior=st.integers(0, 50), lag=st.integers(-3, 8), max_lag=st.integers(0, 5))
def test_no_sample_beyond_max_version_lag_is_admitted(behavior: int, lag: int,
                                                      max_lag: int) -> None:
    train = behavior + lag
    assume(train >= 0)
    v = f"v{behavior:04d}"
    d = AdmissionController(max_version_lag=max_lag).admit(group(version=v), lease(v), train)
    assert d.admitted == (0 <= train - behavior <= max_lag)
    assert d.lag == train - behavior


def test_drift_gate() -> None:
    ctl = AdmissionController(drift_tol=0.05)
    assert ctl.admit(group(), lease(), 0).reason == "drift_unmeasured"
    assert ctl.admit(group(), lease(), 0, drift=0.2).reason == "sample_drift"
    assert ctl.admit(group(), lease(), 0, drift=0.01).admitted


def test_drop_censored_rule_reports_censored_members() -> None:
    ctl = AdmissionController(censor_rule="drop_censored")
    one = replace(group(), 1, reward=None, **CENSORED)
    d = ctl.admit(one, lease(), 0)
    assert d.admitted and d.censored_episode_ids == ("ep1",) and d.n_censored == 1
    three = group(1) + [make_traj(episode_id=f"ep{i}", sample_index=i, reward=None,
                                  termination=Termination.INFRA_ABORT) for i in (1, 2, 3)]
    assert ctl.admit(three, lease(), 0).reason == "too_few_uncensored"


def test_strict_mode_raises_named_errors_and_still_counts() -> None:
    ctl = AdmissionController(strict=True)
    with pytest.raises(StalePolicyError):
        ctl.admit(group(), lease(), 3)
    with pytest.raises(StalePolicyError):
        ctl.admit(group(version="v0004"), lease("v0004"), 3)
    with pytest.raises(MixedPolicyGroupError):
        ctl.admit(replace(group(), 0, mixed_policy=True), lease(), 0)
    assert ctl.admit(group(3), lease(), 0).reason == "incomplete_group"  # a discard, no raise
    overall = ctl.stats.rates(by=())[0]
    assert (overall.n_samples, overall.n_stale, overall.n_dropped) == (15, 8, 15)


def test_bad_configuration_is_refused() -> None:
    for kwargs in ({"max_version_lag": -1}, {"max_version_lag": True}, {"drift_tol": -1.0},
                   {"censor_rule": "zero_fill"}, {"min_uncensored": 0}):
        with pytest.raises(ConfigError):
            AdmissionController(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ContractError):
        AdmissionController().admit(group(), lease(), -1)
    with pytest.raises(ConfigError):
        AdmissionStats(length_edges=(10, 5))


def test_length_bands() -> None:
    s = AdmissionStats()
    assert [s.length_band(n) for n in (0, 63, 64, 255, 256, 1023, 1024, 10**6)] == [
        "tokens<64", "tokens<64", "tokens64-255", "tokens64-255", "tokens256-1023",
        "tokens256-1023", "tokens>=1024", "tokens>=1024"]


def test_rates_are_stratified_by_family_length_and_reward() -> None:
    ctl = AdmissionController(censor_rule="drop_censored")
    short_ok = group(task_family="fam-a", num_action_tokens=10)
    long_fail = group(task_family="fam-b", num_action_tokens=2000,
                      reward={"task_success": 0.0})
    ctl.admit(short_ok, lease(), 0)  # admitted
    ctl.admit(long_fail, lease(), 1)  # stale: the long failures are the ones dropped
    ctl.admit(replace(short_ok, 0, reward=None, **CENSORED), lease(), 0)  # 1 excluded
    by_family = {dict(r.key)["task_family"]: r for r in ctl.stats.rates(by=("task_family",))}
    assert (by_family["fam-a"].n_samples, by_family["fam-a"].n_dropped) == (8, 1)
    assert by_family["fam-a"].stale_rate == 0.0 and by_family["fam-a"].drop_rate == 1 / 8
    assert by_family["fam-b"].stale_rate == 1.0 and by_family["fam-b"].drop_rate == 1.0
    by_len = {dict(r.key)["length_band"]: r.stale_rate
              for r in ctl.stats.rates(by=("length_band",))}
    assert by_len == {"tokens<64": 0.0, "tokens>=1024": 1.0}
    by_reward = {dict(r.key)["reward_band"]: (r.n_samples, r.n_dropped)
                 for r in ctl.stats.rates(by=("reward_band",))}
    assert by_reward == {"success": (7, 0), "failure": (4, 4), "unscored": (1, 1)}
    full = ctl.stats.rates()
    assert sum(r.n_samples for r in full) == 12 and len(full[0].key) == 3
    summary = ctl.stats.to_dict()
    assert set(summary) == {"overall", "task_family", "length_band", "reward_band", "strata"}
    assert summary["overall"][0]["reasons"] == {"censored_member_excluded": 1, "stale_policy": 4}
    with pytest.raises(ConfigError):
        ctl.stats.rates(by=("colour",))


def test_apply_decision_records_the_outcome_in_the_ledger(tmp_path: Path) -> None:
    ctl = AdmissionController()
    with Ledger(tmp_path / "l.sqlite") as ledger:
        cases = {"a": (group(), 0), "b": (group(), 1), "c": (group(3), 0)}
        for gid, (members, train) in cases.items():
            the_lease = lease(group_id=gid)
            members = [replace(members, i, group_id=gid)[i] for i in range(len(members))]
            ledger.record_collected(the_lease, GroupSummary.from_trajectories(members))
            apply_decision(ledger, ctl.admit(members, the_lease, train))
        rows = {g: ledger.get(g) for g in cases}
        assert (rows["a"].state, rows["b"].state, rows["c"].state) == (
            "admitted", "quarantined", "discarded")
        assert (rows["b"].reason, rows["c"].reason) == ("stale_policy", "incomplete_group")
        assert rows["c"].incomplete and rows["a"].summary.task_family == "json-repair-v1"
