"""The admission queue between the generator and the trainer (staleness admission,
docs/concepts.md).

The generator puts *rounds* (the complete, verified groups one RL step consumes, sampled by
one behaviour version); the trainer takes round ``r`` at its step ``r`` and every group is
decided then, at the trainer's version ``u`` (``AdmissionController``: complete groups only,
one behaviour version per group, the version gate ``u - v <= max_version_lag``, the drift gate
on D_sample when a tolerance is set, the censoring rule). The decision goes into the ledger:
admitted, or quarantined/discarded *with its reason*, once (a group already decided by an
earlier launch is decided again and must agree with the ledger).

Capacity (generator backpressure), counted in groups with B groups per round::

    accepted + running + B <= (max_version_lag + v + 1) * B

``accepted``: groups ever put (consumed or waiting), ``running``: groups of rounds started but
not yet put, ``v``: the latest published version index (AReaL's staleness rule). A generator
that would break it waits (``wait_to_start``); ``start`` refuses with ``QueueCapacityError``.
After a resume both counters are rebuilt from what the run directory holds (rounds consumed
plus rounds buffered in complete traces), never reset, so the capacity is not inflated.

What every take reports (``RoundTake.report``): the queue age and Δ_time of each group
(seconds: the wait since it was queued; trainer consume time − rollout finish time), Δ_version
(u − v), D_sample where measured, the high-water mark of waiting groups, the counters and
capacity, and the decisions' sample rates stratified by task family, length and reward.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from closedloop.errors import LedgerInconsistencyError, QueueCapacityError, QueueTimeoutError
from closedloop.rollout.admission import (
    AdmissionController,
    AdmissionDecision,
    AdmissionStats,
    apply_decision,
)
from closedloop.rollout.ledger import GroupSummary, Ledger
from closedloop.rollout.verifier_step import CollectedGroup

__all__ = ["AdmissionQueue", "QueuedRound", "RoundTake", "finished_at"]

DriftOf = Callable[[CollectedGroup], float | None]
"""D_sample of a group under the trainer's current weights."""


def finished_at(group: CollectedGroup) -> float:
    """Wall-clock time (epoch seconds) the group's last rollout finished."""
    return max(datetime.fromisoformat(ep.trajectory.rollout_finished_at).timestamp()
               for ep in group.episodes)


@dataclass(frozen=True)
class QueuedRound:
    """A round as the generator hands it over: its groups (scored by the verifier step), the
    behaviour version that sampled them and when it was queued (epoch seconds)."""

    round: int
    behavior_version: str
    groups: tuple[CollectedGroup, ...]
    queued_at: float
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RoundTake:
    """What the trainer took for one round: all its groups and the admitted ones (in order),
    every decision, the round's report (decisions, Δ_version, D_sample, stratified rates: a
    function of the data) and its timing (queue ages, Δ_time, counters: a function of when
    the roles ran)."""

    round: int
    groups: tuple[CollectedGroup, ...]
    admitted: tuple[CollectedGroup, ...]
    decisions: tuple[AdmissionDecision, ...]
    report: dict[str, Any] = field(default_factory=dict)
    timing: dict[str, Any] = field(default_factory=dict)


class AdmissionQueue:
    """Rounds between the generator and the trainer; see the module doc. Thread-safe: the
    generator puts from its thread, the trainer takes (and writes the ledger) from its own."""

    def __init__(self, controller: AdmissionController, ledger: Ledger, *,
                 groups_per_round: int, max_version_lag: int,
                 drift: DriftOf | None = None) -> None:
        self.controller = controller
        self.ledger = ledger
        self.groups_per_round = groups_per_round
        self.max_version_lag = max_version_lag
        self.drift = drift
        self._cond = threading.Condition()
        self._rounds: dict[int, QueuedRound] = {}
        self._started: set[int] = set()
        self.accepted = 0
        self.running = 0
        self.high_water = 0
        self.published_index = 0
        self._closed: BaseException | None = None

    # ------------------------------------------------------------------ capacity
    def capacity(self, published_index: int) -> int:
        """Groups the rule allows in total at published version ``published_index``."""
        return (self.max_version_lag + published_index + 1) * self.groups_per_round

    def may_start(self, published_index: int) -> bool:
        """Whether one more round fits (``accepted + running + B <= capacity``)."""
        return (self.accepted + self.running + self.groups_per_round
                <= self.capacity(published_index))

    def start(self, round_index: int, published_index: int) -> None:
        """Reserve round ``round_index`` for the generator (``QueueCapacityError`` when the
        rule refuses it, or the round was started already)."""
        with self._cond:
            if round_index in self._started or round_index in self._rounds:
                raise QueueCapacityError(f"round {round_index} was started already")
            if not self.may_start(published_index):
                raise QueueCapacityError(
                    f"round {round_index}: {self.accepted} accepted + {self.running} running "
                    f"+ {self.groups_per_round} > capacity {self.capacity(published_index)} at "
                    f"v{published_index:04d} (max_version_lag {self.max_version_lag})")
            self._started.add(round_index)
            self.running += self.groups_per_round

    def wait_to_start(self, round_index: int, timeout_s: float) -> int:
        """Block until the rule lets round ``round_index`` start at the published version, then
        reserve it; return that version's index. ``QueueTimeoutError`` after ``timeout_s``."""
        self.wait_until(lambda: self.may_start(self.published_index), timeout_s,
                        f"capacity for round {round_index}")
        v = self.published_index
        self.start(round_index, v)
        return v

    def notify(self) -> None:
        """Wake waiters (an order was drawn, a round taken)."""
        with self._cond:
            self._cond.notify_all()

    def publish(self, version_index_: int) -> None:
        """The trainer staged ``v_{version_index_}``: the capacity rule's ``v`` moves on."""
        with self._cond:
            self.published_index = max(self.published_index, version_index_)
            self._cond.notify_all()

    def wait_until(self, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Block until ``ready()`` (checked whenever the queue is notified);
        ``QueueTimeoutError`` naming ``what`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not ready():
                self._raise_if_closed()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise QueueTimeoutError(f"waited {timeout_s:.0f}s for {what}")
                self._cond.wait(timeout=min(0.5, left))

    def close(self, error: BaseException) -> None:
        """Stop every waiter with ``error`` (the other side failed)."""
        with self._cond:
            self._closed = error
            self._cond.notify_all()

    def _raise_if_closed(self) -> None:
        if self._closed is not None:
            raise QueueTimeoutError(f"the queue was closed: {self._closed!r}") from self._closed

    # ------------------------------------------------------------------ generator side
    def put(self, queued: QueuedRound) -> None:
        """Hand over a round the generator started (its reservation becomes accepted)."""
        with self._cond:
            if queued.round not in self._started:
                raise QueueCapacityError(f"round {queued.round} was never started")
            self._started.discard(queued.round)
            self._rounds[queued.round] = queued
            self.running -= self.groups_per_round
            self.accepted += len(queued.groups)
            self.high_water = max(self.high_water, self.waiting_groups())
            self._cond.notify_all()

    def restore(self, consumed_rounds: int, buffered: Sequence[QueuedRound]) -> None:
        """After a resume: ``consumed_rounds`` rounds were taken before, ``buffered`` are the
        complete rounds the run directory still holds (they count as accepted, never reset)."""
        with self._cond:
            self._rounds = {q.round: q for q in buffered}
            self._started.clear()
            self.running = 0
            self.accepted = consumed_rounds * self.groups_per_round + sum(
                len(q.groups) for q in buffered)
            self.high_water = max(self.high_water, self.waiting_groups())

    def waiting_groups(self) -> int:
        """Groups queued and not yet taken."""
        return sum(len(q.groups) for q in self._rounds.values())

    def has(self, round_index: int) -> bool:
        """Whether round ``round_index`` is queued."""
        with self._cond:
            return round_index in self._rounds

    # ------------------------------------------------------------------ trainer side
    def take(self, round_index: int, train_version_index: int,
             timeout_s: float | None = None) -> RoundTake:
        """Wait for round ``round_index``, decide every group at the trainer's version and
        record the decisions in the ledger; the admitted groups and the round's report."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        t0 = time.monotonic()
        with self._cond:
            while round_index not in self._rounds:
                self._raise_if_closed()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise QueueTimeoutError(f"round {round_index} did not arrive within "
                                            f"{timeout_s:.0f}s")
                self._cond.wait(timeout=0.5 if left is None else min(0.5, left))
            queued = self._rounds.pop(round_index)
            self._cond.notify_all()
        return self._decide(queued, train_version_index, time.monotonic() - t0)

    def _decide(self, queued: QueuedRound, u: int, waited: float) -> RoundTake:
        now = time.time()
        stats = AdmissionStats()
        self.controller.stats = stats
        admitted, decisions, rows, ages, lags_t = [], [], [], [], []
        for g in queued.groups:
            trajs = [ep.trajectory for ep in g.episodes]
            drift = self.drift(g) if self.drift is not None and \
                self.controller.drift_tol is not None else None
            decision = self.controller.admit(trajs, g.lease, u, drift=drift)
            self._record(g, decision)
            decisions.append(decision)
            if decision.admitted:
                admitted.append(g)
            rows.append({"group_id": g.lease.group_id, "disposition": decision.disposition,
                         "reason": decision.reason, "delta_version": decision.lag,
                         "d_sample": decision.drift})
            ages.append(round(now - queued.queued_at, 3))
            lags_t.append(round(now - finished_at(g), 3))
        report = {"round": queued.round, "behavior_version": queued.behavior_version,
                  "train_version": f"v{u:04d}", "groups": rows,
                  "max_delta_version": max((r["delta_version"] for r in rows
                                            if r["delta_version"] is not None), default=None),
                  "capacity_groups": self.capacity(u), "rates": stats.to_dict()}
        timing = {"queue_age_s": ages, "delta_time_s": lags_t, "trainer_wait_s": waited,
                  "high_water_groups": self.high_water, "accepted_groups": self.accepted,
                  "running_groups": self.running, "waiting_groups": self.waiting_groups(),
                  **queued.seconds}
        return RoundTake(queued.round, queued.groups, tuple(admitted), tuple(decisions),
                         report, timing)

    def _record(self, group: CollectedGroup, decision: AdmissionDecision) -> None:
        """The decision into the ledger, once: a group an earlier launch decided must have
        been decided the same way (``LedgerInconsistencyError`` otherwise)."""
        gid = group.lease.group_id
        if gid not in self.ledger.group_ids():
            self.ledger.record_collected(group.lease, GroupSummary.from_trajectories(
                [ep.trajectory for ep in group.episodes]))
        row = self.ledger.get(gid)
        if row.state == "collected":
            apply_decision(self.ledger, decision)
            return
        expected = {"admit": ("admitted", "consumed"), "quarantine": ("quarantined",),
                    "discard": ("discarded",)}[decision.disposition]
        if row.state not in expected or (decision.reason and row.reason != decision.reason):
            raise LedgerInconsistencyError(
                f"group {gid} is {row.state} ({row.reason}) in the ledger, but admission now "
                f"decides {decision.disposition} ({decision.reason})")
