"""Complete-group admission: version, manifest, staleness, drift and censoring gates.

Staleness admission (docs/concepts.md): a group
reaches the trainer only when every sibling was sampled by the lease's behaviour manifest, the
version lag ``train_version - behavior_version`` is within a hard bound, and the declared
censoring rule accepts it. Everything else is quarantined or discarded *with a reason*, never
trained on silently. Checks run in this order; the first failure decides:

=====================  ===========  =====================================================
reason                 disposition  when
=====================  ===========  =====================================================
empty_group            quarantine   no trajectories
group_mismatch         quarantine   a member's group, task, seed or snapshot differs from
                                    the lease, or two members share an episode/sample index
oversized_group        quarantine   more members than the lease's ``group_size``
mixed_policy_group     quarantine   members have >1 behaviour version, a version other than
                                    the lease's, or ``mixed_policy=True``
manifest_mismatch      quarantine   a member's manifest or sampler hash differs from the lease
member_quarantined     quarantine   a member carries a ``quarantine_reason`` (e.g. tampering)
incomplete_group       discard      fewer members than ``group_size`` (never back-filled)
invalid_version        quarantine   the lease's version is not of the form ``v%04d``
negative_lag           quarantine   behaviour version newer than the trainer (a bug upstream)
stale_policy           quarantine   lag > ``max_version_lag`` (a hard bound)
drift_unmeasured       quarantine   ``drift_tol`` is set but no drift was measured
sample_drift           quarantine   measured drift > ``drift_tol``
censored_member        discard      rule ``discard_group`` and a member is censored
too_few_uncensored     discard      rule ``drop_censored`` and < 2 uncensored members
=====================  ===========  =====================================================

The censoring rule names match ``closedloop.learn.credit.CENSOR_RULES``; under
``drop_censored`` an admitted group reports its censored members so the estimator excludes
them. With ``strict=True`` the controller raises ``StalePolicyError`` (stale_policy,
negative_lag) or ``MixedPolicyGroupError`` (mixed_policy_group) instead of returning.

Every decision also feeds :class:`AdmissionStats`, which counts samples per stratum of task
family x length band x reward band, so stale and dropped rates can be compared across strata.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from closedloop.contracts.records import GroupLease, TrajectoryRecord
from closedloop.errors import (
    ClosedloopError,
    ConfigError,
    ContractError,
    MixedPolicyGroupError,
    StalePolicyError,
)
from closedloop.policy.registry import version_index
from closedloop.rollout.ledger import Ledger

__all__ = [
    "CENSOR_RULES",
    "DISPOSITIONS",
    "AdmissionController",
    "AdmissionDecision",
    "AdmissionStats",
    "StratumRate",
    "apply_decision",
]

CensorRule = Literal["discard_group", "drop_censored"]
CENSOR_RULES: tuple[str, ...] = ("discard_group", "drop_censored")
Disposition = Literal["admit", "quarantine", "discard"]
DISPOSITIONS: Mapping[str, Disposition] = {
    "empty_group": "quarantine", "group_mismatch": "quarantine",
    "oversized_group": "quarantine", "mixed_policy_group": "quarantine",
    "manifest_mismatch": "quarantine", "member_quarantined": "quarantine",
    "incomplete_group": "discard", "invalid_version": "quarantine",
    "negative_lag": "quarantine", "stale_policy": "quarantine",
    "drift_unmeasured": "quarantine", "sample_drift": "quarantine",
    "censored_member": "discard", "too_few_uncensored": "discard",
}
_STALE_REASONS = frozenset({"stale_policy", "negative_lag"})
_EXCLUDED = "censored_member_excluded"


@dataclass(frozen=True)
class AdmissionDecision:
    """The verdict on one group.

    ``lag`` is ``train_version_index - index(lease.behavior_policy_version)`` (None when the
    versions could not be read). ``censored_episode_ids`` lists members whose termination is
    censored; under ``drop_censored`` an admitted group trains without them.
    """

    group_id: str
    admitted: bool
    disposition: Disposition
    reason: str | None
    lag: int | None
    behavior_version: str
    train_version_index: int
    n_members: int
    censored_episode_ids: tuple[str, ...]
    censor_rule: str
    drift: float | None = None
    detail: str = ""

    @property
    def n_censored(self) -> int:
        """Number of censored members."""
        return len(self.censored_episode_ids)


@dataclass(frozen=True)
class StratumRate:
    """Sample counts and rates of one stratum (``key`` pairs each dimension with its value)."""

    key: tuple[tuple[str, str], ...]
    n_samples: int
    n_admitted: int
    n_stale: int
    n_dropped: int
    reasons: Mapping[str, int] = field(default_factory=dict)

    @property
    def stale_rate(self) -> float:
        """Fraction of samples rejected as stale (stale_policy or negative_lag)."""
        return self.n_stale / self.n_samples if self.n_samples else 0.0

    @property
    def drop_rate(self) -> float:
        """Fraction of samples that did not reach the gradient, for any reason."""
        return self.n_dropped / self.n_samples if self.n_samples else 0.0


_DIMENSIONS = ("task_family", "length_band", "reward_band")


class AdmissionStats:
    """Per-sample outcome counts, stratified by task family, length band and reward band.

    A sample is *dropped* when its group was quarantined or discarded, or when it was a
    censored member excluded from an admitted group (reason ``censored_member_excluded``).
    Length bands split ``num_action_tokens`` at ``length_edges``; reward bands are
    ``unscored`` (reward None), ``success`` (``reward[reward_key] >= success_threshold``) and
    ``failure``.
    """

    def __init__(self, length_edges: Sequence[int] = (64, 256, 1024),
                 reward_key: str = "task_success", success_threshold: float = 0.5) -> None:
        edges = list(length_edges)
        if any(b <= a for a, b in itertools.pairwise(edges)) or any(e <= 0 for e in edges):
            raise ConfigError("admission.length_edges", "must be positive and increasing")
        self.length_edges = tuple(edges)
        self.reward_key = reward_key
        self.success_threshold = success_threshold
        self._counts: Counter[tuple[str, str, str, str]] = Counter()

    def length_band(self, num_action_tokens: int) -> str:
        """Return the band label of a trajectory length, e.g. ``tokens64-255``."""
        lo = 0
        for edge in self.length_edges:
            if num_action_tokens < edge:
                return f"tokens<{edge}" if lo == 0 else f"tokens{lo}-{edge - 1}"
            lo = edge
        return f"tokens>={lo}"

    def reward_band(self, traj: TrajectoryRecord) -> str:
        """Return ``unscored``, ``success`` or ``failure``."""
        value = None if traj.reward is None else traj.reward.get(self.reward_key)
        if value is None or not math.isfinite(value):
            return "unscored"
        return "success" if value >= self.success_threshold else "failure"

    def record(self, group: Sequence[TrajectoryRecord], decision: AdmissionDecision) -> None:
        """Count every member of ``group`` under the decision's outcome."""
        excluded = set(decision.censored_episode_ids) if decision.admitted else set()
        for traj in group:
            if decision.admitted:
                outcome = _EXCLUDED if traj.episode_id in excluded else "admitted"
            else:
                outcome = decision.reason or "rejected"
            key = (traj.task_family, self.length_band(traj.num_action_tokens),
                   self.reward_band(traj), outcome)
            self._counts[key] += 1

    def rates(self, by: Sequence[str] = _DIMENSIONS) -> list[StratumRate]:
        """Return one :class:`StratumRate` per stratum over the dimensions ``by``, sorted."""
        unknown = sorted(set(by) - set(_DIMENSIONS))
        if unknown:
            raise ConfigError("by", f"unknown dimensions {unknown}; known {_DIMENSIONS}")
        cells: dict[tuple[tuple[str, str], ...], Counter[str]] = {}
        for (family, length, reward, outcome), n in self._counts.items():
            values = {"task_family": family, "length_band": length, "reward_band": reward}
            key = tuple((dim, values[dim]) for dim in by)
            cells.setdefault(key, Counter())[outcome] += n
        out = []
        for key in sorted(cells):
            c = cells[key]
            total = sum(c.values())
            out.append(StratumRate(
                key=key, n_samples=total, n_admitted=c["admitted"],
                n_stale=sum(c[r] for r in _STALE_REASONS),
                n_dropped=total - c["admitted"],
                reasons={r: n for r, n in sorted(c.items()) if r != "admitted"}))
        return out

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON summary: overall and per single dimension and full strata."""
        def rows(by: Sequence[str]) -> list[dict[str, Any]]:
            return [{**dict(r.key), "n_samples": r.n_samples, "n_admitted": r.n_admitted,
                     "stale_rate": r.stale_rate, "drop_rate": r.drop_rate,
                     "reasons": dict(r.reasons)} for r in self.rates(by)]
        return {"overall": rows(()), **{dim: rows((dim,)) for dim in _DIMENSIONS},
                "strata": rows(_DIMENSIONS)}


class AdmissionController:
    """Decide whether complete verified groups may reach the trainer (see module docstring).

    max_version_lag: hard bound on ``train_version - behavior_version`` (0 = synchronous).
    require_one_behavior_version: reject groups whose members disagree on the version.
    drift_tol: if set, ``admit`` needs a measured ``drift`` (mean |Δ log p| over action
    tokens, D_sample in docs/concepts.md, staleness admission) and rejects groups above it.
    censor_rule: ``discard_group`` (default) or ``drop_censored``; min_uncensored applies to
    the latter. strict: raise the named errors instead of returning a rejection.
    """

    def __init__(self, max_version_lag: int = 0, require_one_behavior_version: bool = True,
                 drift_tol: float | None = None, *, censor_rule: CensorRule = "discard_group",
                 min_uncensored: int = 2, strict: bool = False,
                 stats: AdmissionStats | None = None) -> None:
        if isinstance(max_version_lag, bool) or not isinstance(max_version_lag, int) \
                or max_version_lag < 0:
            raise ConfigError("rollout.max_version_lag", "must be an int >= 0")
        if drift_tol is not None and not (math.isfinite(drift_tol) and drift_tol >= 0):
            raise ConfigError("admission.drift_tol", "must be a finite number >= 0 or None")
        if censor_rule not in CENSOR_RULES:
            raise ConfigError("admission.censor_rule", f"must be one of {CENSOR_RULES}")
        if min_uncensored < 1:
            raise ConfigError("admission.min_uncensored", "must be >= 1")
        self.max_version_lag = max_version_lag
        self.require_one_behavior_version = require_one_behavior_version
        self.drift_tol = drift_tol
        self.censor_rule = censor_rule
        self.min_uncensored = min_uncensored
        self.strict = strict
        self.stats = stats if stats is not None else AdmissionStats()

    def admit(self, group: Sequence[TrajectoryRecord], lease: GroupLease,
              train_version_index: int, *, drift: float | None = None) -> AdmissionDecision:
        """Return the decision for one group and record it in :attr:`stats`.

        ``train_version_index`` is the trainer's current version as an index (``"v0003"`` ->
        3, see ``closedloop.policy.registry.version_index``).
        """
        censored = tuple(t.episode_id for t in group if t.termination.is_censored)
        if isinstance(train_version_index, bool) or not isinstance(train_version_index, int) \
                or train_version_index < 0:
            raise ContractError(f"train_version_index must be an int >= 0, got "
                                f"{train_version_index!r}")
        lag: int | None = None
        with contextlib.suppress(ClosedloopError):
            lag = train_version_index - version_index(lease.behavior_policy_version)
        reason, detail = self._first_failure(group, lease, lag, drift, censored)
        disposition: Disposition = "admit" if reason is None else DISPOSITIONS[reason]
        decision = AdmissionDecision(
            group_id=lease.group_id, admitted=reason is None, disposition=disposition,
            reason=reason, lag=lag, behavior_version=lease.behavior_policy_version,
            train_version_index=train_version_index, n_members=len(group),
            censored_episode_ids=censored, censor_rule=self.censor_rule, drift=drift,
            detail=detail)
        self.stats.record(group, decision)
        if self.strict and reason in _STALE_REASONS:
            raise StalePolicyError(f"group {lease.group_id}: {reason}: {detail}")
        if self.strict and reason == "mixed_policy_group":
            raise MixedPolicyGroupError(f"group {lease.group_id}: {detail}")
        return decision

    def _first_failure(self, group: Sequence[TrajectoryRecord], lease: GroupLease,
                       lag: int | None, drift: float | None,
                       censored: tuple[str, ...]) -> tuple[str | None, str]:
        for check in (_structure, self._versions, _manifest, _members):
            failure = check(group, lease)
            if failure is not None:
                return failure
        if len(group) < lease.group_size:
            return "incomplete_group", f"{len(group)} of {lease.group_size} members"
        if lag is None:
            return "invalid_version", "behaviour version is not of the form v%04d"
        if lag < 0:
            return "negative_lag", f"behaviour version is {-lag} ahead of the trainer"
        if lag > self.max_version_lag:
            return "stale_policy", f"lag {lag} > max_version_lag {self.max_version_lag}"
        if self.drift_tol is not None:
            if drift is None or not math.isfinite(drift):
                return "drift_unmeasured", "drift_tol is set but drift was not measured"
            if drift > self.drift_tol:
                return "sample_drift", f"drift {drift:.4g} > drift_tol {self.drift_tol:.4g}"
        if censored and self.censor_rule == "discard_group":
            return "censored_member", f"{len(censored)} censored member(s)"
        if len(group) - len(censored) < self.min_uncensored:
            return "too_few_uncensored", f"{len(group) - len(censored)} uncensored member(s)"
        return None, ""

    def _versions(self, group: Sequence[TrajectoryRecord],
                  lease: GroupLease) -> tuple[str, str] | None:
        versions = sorted({t.behavior_policy_version for t in group})
        if self.require_one_behavior_version and len(versions) > 1:
            return "mixed_policy_group", f"behaviour versions {versions}"
        if any(v != lease.behavior_policy_version for v in versions):
            return "mixed_policy_group", (f"members sampled by {versions}, lease says "
                                          f"{lease.behavior_policy_version}")
        mixed = [t.episode_id for t in group if t.mixed_policy]
        if mixed:
            return "mixed_policy_group", f"mixed-policy episodes {mixed}"
        return None


def _structure(group: Sequence[TrajectoryRecord], lease: GroupLease) -> tuple[str, str] | None:
    if not group:
        return "empty_group", "no trajectories"
    for t in group:
        ours = (t.group_id, t.task_id, t.seed, t.base_snapshot_id)
        theirs = (lease.group_id, lease.task_id, lease.seed, lease.base_snapshot_id)
        if ours != theirs:
            return "group_mismatch", f"episode {t.episode_id}: {ours} != lease {theirs}"
    if len({t.episode_id for t in group}) < len(group) \
            or len({t.sample_index for t in group}) < len(group):
        return "group_mismatch", "two members share an episode id or sample index"
    if len(group) > lease.group_size:
        return "oversized_group", f"{len(group)} members for group_size {lease.group_size}"
    return None


def _manifest(group: Sequence[TrajectoryRecord], lease: GroupLease) -> tuple[str, str] | None:
    for t in group:
        if t.policy_manifest_hash != lease.behavior_manifest_hash:
            return "manifest_mismatch", f"episode {t.episode_id}: policy manifest differs"
        if t.sampler_config.config_hash() != lease.sampler_config_hash:
            return "manifest_mismatch", f"episode {t.episode_id}: sampler config differs"
    return None


def _members(group: Sequence[TrajectoryRecord], lease: GroupLease) -> tuple[str, str] | None:
    bad = [f"{t.episode_id}:{t.quarantine_reason}" for t in group if t.quarantine_reason]
    return ("member_quarantined", ", ".join(bad)) if bad else None


def apply_decision(ledger: Ledger, decision: AdmissionDecision) -> None:
    """Record a decision in the ledger: admit, quarantine(reason) or discard(reason).

    The group must already be ``collected`` in the ledger.
    """
    if decision.disposition == "admit":
        ledger.admit(decision.group_id)
    elif decision.disposition == "quarantine":
        ledger.quarantine(decision.group_id, decision.reason or "quarantined")
    else:
        ledger.discard(decision.group_id, decision.reason or "discarded")
