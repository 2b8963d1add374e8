"""The admission queue: capacity and backpressure, the decisions at the trainer's version, the
ledger written once, a resume that does not inflate the capacity, and a generator and a
trainer in their own threads with random delays and injected faults."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from closedloop.contracts import Episode, GroupLease, TrajectoryRecord, sha256_hex
from closedloop.errors import LedgerInconsistencyError, QueueCapacityError, QueueTimeoutError
from closedloop.rollout.admission import AdmissionController
from closedloop.rollout.ledger import Ledger
from closedloop.rollout.queues import AdmissionQueue, QueuedRound
from closedloop.rollout.verifier_step import CollectedGroup
from tests.factories import SAMPLER, make_traj

H = sha256_hex("x")
B, G = 2, 3
NOW = "2026-12-03T10:00:00.000+00:00"


def make_group(gid: str, version: str, *, members: int = G, mixed: bool = False
               ) -> CollectedGroup:
    """A complete (or short) group sampled by ``version``; ``mixed``: one member by another."""
    lease = GroupLease(group_id=gid, run_id="run", task_id="json-repair-v1/a/000-x", seed=11,
                       base_snapshot_id="snap", behavior_manifest_hash=H,
                       behavior_policy_version=version, sampler_config_hash=SAMPLER.config_hash(),
                       group_size=G)
    trajs: list[TrajectoryRecord] = []
    for i in range(members):
        v = "v9999" if mixed and i == 0 else version
        reward = {"task_success": float(i % 2)}
        trajs.append(make_traj(episode_id=f"{gid}/{i}", group_id=gid, sample_index=i,
                               behavior_policy_version=v, reward=reward,
                               rollout_finished_at=NOW))
    return CollectedGroup(lease, tuple(Episode(t, ()) for t in trajs))


def make_queue(tmp_path: Path, lag: int, **kw: Any) -> tuple[AdmissionQueue, Ledger]:
    ledger = Ledger(tmp_path / "ledger.sqlite")
    queue = AdmissionQueue(AdmissionController(lag, **kw), ledger, groups_per_round=B,
                           max_version_lag=lag)
    return queue, ledger


def round_of(r: int, version: str, groups: list[CollectedGroup]) -> QueuedRound:
    return QueuedRound(r, version, tuple(groups), time.time())


def test_capacity_is_areal_rule_and_start_refuses_past_it(tmp_path: Path) -> None:
    queue, _ = make_queue(tmp_path, lag=1)
    assert queue.capacity(0) == (1 + 0 + 1) * B
    queue.start(0, published_index=0)
    queue.start(1, published_index=0)  # accepted 0 + running 2 + 2 <= 4
    with pytest.raises(QueueCapacityError, match="capacity 4"):
        queue.start(2, published_index=0)
    queue.put(round_of(0, "v0000", [make_group("s0-g0", "v0000"), make_group("s0-g1", "v0000")]))
    with pytest.raises(QueueCapacityError):
        queue.start(2, published_index=0)  # put does not free capacity: only a new version does
    queue.start(2, published_index=1)
    with pytest.raises(QueueCapacityError, match="started already"):
        queue.start(2, published_index=5)


def test_the_generator_waits_for_a_publication_and_times_out_without_one(tmp_path: Path
                                                                         ) -> None:
    queue, _ = make_queue(tmp_path, lag=0)
    queue.start(0, published_index=0)
    with pytest.raises(QueueTimeoutError, match="capacity for round 1"):
        queue.wait_to_start(1, timeout_s=0.3)
    threading.Timer(0.2, queue.publish, args=(1,)).start()
    assert queue.wait_to_start(1, timeout_s=5.0) == 1


def test_take_decides_at_the_trainers_version_and_writes_the_ledger_once(tmp_path: Path
                                                                          ) -> None:
    queue, ledger = make_queue(tmp_path, lag=1)
    queue.start(3, published_index=3)
    groups = [make_group("fresh", "v0002"), make_group("stale", "v0001"),
              make_group("mixed", "v0002", mixed=True), make_group("short", "v0002", members=2)]
    queue.put(round_of(3, "v0002", groups))
    taken = queue.take(3, train_version_index=3, timeout_s=1.0)
    assert [g.lease.group_id for g in taken.admitted] == ["fresh"]
    reasons = {d.group_id: d.reason for d in taken.decisions}
    assert reasons == {"fresh": None, "stale": "stale_policy", "mixed": "mixed_policy_group",
                       "short": "incomplete_group"}
    states = {g: (ledger.get(g).state, ledger.get(g).reason) for g in reasons}
    assert states == {"fresh": ("admitted", None), "stale": ("quarantined", "stale_policy"),
                      "mixed": ("quarantined", "mixed_policy_group"),
                      "short": ("discarded", "incomplete_group")}
    assert [r["delta_version"] for r in taken.report["groups"]] == [1, 2, 1, 1]
    assert taken.report["rates"]["overall"][0]["n_samples"] == 3 + 3 + 3 + 2
    assert len(taken.timing["queue_age_s"]) == 4 and taken.timing["delta_time_s"][0] > 0

    # a resumed launch decides the same round again: the ledger agrees, nothing is re-logged
    queue.start(3, published_index=3)
    queue.put(round_of(3, "v0002", groups))
    again = queue.take(3, train_version_index=3, timeout_s=1.0)
    assert [d.reason for d in again.decisions] == [d.reason for d in taken.decisions]
    events = Counter(e.group_id for e in ledger.events() if e.kind == "transition")
    assert all(n == 2 for n in events.values()), events  # collected + one decision, once

    # a decision that would now differ (a trainer at another version) is refused
    queue.start(3, published_index=4)
    queue.put(round_of(3, "v0002", groups))
    with pytest.raises(LedgerInconsistencyError, match="fresh is admitted"):
        queue.take(3, train_version_index=4, timeout_s=1.0)


def test_the_drift_gate_quarantines_a_group_past_its_tolerance(tmp_path: Path) -> None:
    queue, ledger = make_queue(tmp_path, lag=1, drift_tol=0.05)
    drift = {"calm": 0.01, "moved": 0.2}
    queue.drift = lambda g: drift[g.lease.group_id]
    queue.start(1, published_index=1)
    queue.put(round_of(1, "v0000", [make_group("calm", "v0000"), make_group("moved", "v0000")]))
    taken = queue.take(1, train_version_index=1)
    assert [(r["group_id"], r["reason"], r["d_sample"]) for r in taken.report["groups"]] == [
        ("calm", None, 0.01), ("moved", "sample_drift", 0.2)]
    assert ledger.get("moved").reason == "sample_drift"


def test_a_resumed_queue_keeps_its_capacity(tmp_path: Path) -> None:
    """After a resume at step 3 with round 4 buffered (lag 1), round 5 must still wait for v4:
    counters rebuilt from the run directory, not reset (a reset allows v + L + 1 more rounds)."""
    queue, _ = make_queue(tmp_path, lag=1)
    buffered = round_of(4, "v0003", [make_group("s4-g0", "v0003"), make_group("s4-g1", "v0003")])
    queue.restore(consumed_rounds=3, buffered=[buffered])
    assert queue.accepted == 4 * B
    queue.start(3, published_index=3)  # round 3's trace was partial: collected again
    with pytest.raises(QueueCapacityError):
        queue.start(5, published_index=3)
    queue.start(5, published_index=4)
    (tmp_path / "reset").mkdir()
    reset, _ = make_queue(tmp_path / "reset", lag=1)
    assert reset.may_start(3)  # counters reset to 0 would have let round 5 start at v3


LAG = 1
ROUNDS = 12


def _run_threads(tmp_path: Path, seed: int) -> tuple[list[tuple[str, int]], dict[str, str],
                                                     Ledger]:
    """A generator thread and a trainer thread with random delays. The generator samples
    round r at the version the schedule allows, but injects faults: a group sampled by a
    version older than allowed (stale), a mixed-version group, a group missing a sibling."""
    rng = random.Random(seed)
    queue, ledger = make_queue(tmp_path, lag=LAG)
    injected: dict[str, str] = {}
    trained: list[tuple[str, int]] = []
    errors: list[BaseException] = []

    def generator() -> None:
        try:
            for r in range(ROUNDS):
                v = queue.wait_to_start(r, timeout_s=20.0)
                version = max(0, r - LAG)
                assert version <= v
                groups = []
                for j in range(B):
                    gid, fault = f"s{r:04d}-g{j}", rng.choice(["", "", "", "stale", "mixed",
                                                               "short"])
                    if fault == "stale" and version >= 1:
                        groups.append(make_group(gid, f"v{version - 1:04d}"))
                        injected[gid] = "stale_policy"
                    elif fault == "mixed":
                        groups.append(make_group(gid, f"v{version:04d}", mixed=True))
                        injected[gid] = "mixed_policy_group"
                    elif fault == "short":
                        groups.append(make_group(gid, f"v{version:04d}", members=G - 1))
                        injected[gid] = "incomplete_group"
                    else:
                        groups.append(make_group(gid, f"v{version:04d}"))
                time.sleep(rng.uniform(0, 0.01))
                queue.put(round_of(r, f"v{version:04d}", groups))
        except BaseException as exc:  # handed to the test's thread
            errors.append(exc)
            queue.close(exc)

    thread = threading.Thread(target=generator)
    thread.start()
    for u in range(ROUNDS):
        taken = queue.take(u, train_version_index=u, timeout_s=20.0)
        for g in taken.admitted:
            for ep in g.episodes:
                trained.append((ep.trajectory.behavior_policy_version, u))
        time.sleep(rng.uniform(0, 0.01))
        queue.publish(u + 1)
    thread.join(20.0)
    assert not errors, errors
    return trained, injected, ledger


@pytest.mark.parametrize("seed", range(4))
def test_random_delays_never_train_past_the_bound_and_quarantine_each_fault_once(
        tmp_path: Path, seed: int) -> None:
    trained, injected, ledger = _run_threads(tmp_path, seed)
    assert trained, "nothing was trained"
    assert all(0 <= u - int(v[1:]) <= LAG for v, u in trained)
    assert injected, "no fault was injected"
    for gid, reason in injected.items():
        row = ledger.get(gid)
        assert (row.state in ("quarantined", "discarded"), row.reason) == (True, reason), gid
    decided = Counter(e.group_id for e in ledger.events()
                      if e.kind == "transition" and e.to_state != "collected")
    assert set(decided.values()) == {1}  # every group decided once
    admitted = set(ledger.group_ids("admitted"))
    assert admitted.isdisjoint(injected)
    assert len(admitted) + len(injected) == ROUNDS * B
