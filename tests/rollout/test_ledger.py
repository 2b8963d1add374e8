"""Contract tests of the SQLite group ledger: state machine, exactly-once, reconciliation."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from closedloop.contracts.records import GroupLease
from closedloop.rollout.ledger import (
    DuplicateConsumptionError,
    DuplicateGroupError,
    IllegalTransitionError,
    Ledger,
    LedgerError,
    LedgerInconsistencyError,
    LedgerSchemaError,
    UnknownGroupError,
)
from closedloop.rollout.ledger import GroupSummary as Summary

H = "sha256:" + "0" * 64


def lease(gid: str, size: int = 4) -> GroupLease:
    return GroupLease(group_id=gid, run_id="run", task_id=f"task-{gid}", seed=1,
                      base_snapshot_id="snap", behavior_manifest_hash=H,
                      behavior_policy_version="v0000", sampler_config_hash=H, group_size=size)


def collected(ledger: Ledger, *gids: str, n: int = 4) -> None:
    for gid in gids:
        ledger.record_collected(lease(gid), Summary(n_trajectories=n))


def admitted(ledger: Ledger, *gids: str) -> None:
    collected(ledger, *gids)
    for gid in gids:
        ledger.admit(gid)


@pytest.fixture
def ledger(tmp_path: Path) -> Ledger:
    with Ledger(tmp_path / "ledger.sqlite") as led:
        yield led


def test_happy_path_and_counts(ledger: Ledger) -> None:
    admitted(ledger, "g1", "g2", "g3")
    ledger.mark_consumed(["g1", "g2"], optimizer_step=1, output_policy_version="v0001")
    ledger.quarantine("g3", "stale_policy")
    row = ledger.get("g1")
    assert (row.state, row.consumed_step, row.output_policy_version) == ("consumed", 1, "v0001")
    assert row.lease == lease("g1")
    c = ledger.counts()
    assert (c.consumed, c.quarantined, c.admitted, c.total) == (2, 1, 0, 3)
    assert dict(c.reasons) == {"stale_policy": 1}
    assert ledger.group_ids("consumed") == ["g1", "g2"]
    assert [e.to_state for e in ledger.events("g1")] == ["collected", "admitted", "consumed"]


def test_consuming_twice_raises_and_is_counted(ledger: Ledger) -> None:
    admitted(ledger, "g1")
    ledger.mark_consumed(["g1"], 1, "v0001")
    with pytest.raises(DuplicateConsumptionError):
        ledger.mark_consumed(["g1"], 2, "v0002")
    row = ledger.get("g1")
    assert (row.consumed_step, row.output_policy_version) == (1, "v0001")
    assert ledger.counts().duplicate_consumptions_rejected == 1
    with pytest.raises(DuplicateConsumptionError):
        admitted(ledger, "g2")
        ledger.mark_consumed(["g2", "g2"], 3, "v0003")
    assert ledger.get("g2").state == "admitted"
    assert ledger.counts().duplicates_rejected == 2


def test_require_admitted_refuses_before_the_gradient(ledger: Ledger) -> None:
    admitted(ledger, "a", "b")
    collected(ledger, "c")
    ledger.require_admitted(["a", "b"])
    ledger.mark_consumed(["a"], 1, "v0001")
    with pytest.raises(DuplicateConsumptionError):
        ledger.require_admitted(["b", "a"])
    with pytest.raises(IllegalTransitionError):
        ledger.require_admitted(["c"])
    with pytest.raises(UnknownGroupError):
        ledger.require_admitted(["zzz"])
    assert ledger.counts().duplicate_consumptions_rejected == 1
    assert ledger.get("b").state == "admitted"


def test_batch_is_all_or_nothing(ledger: Ledger) -> None:
    admitted(ledger, "a", "b")
    collected(ledger, "c")  # not admitted yet
    with pytest.raises(IllegalTransitionError) as info:
        ledger.mark_consumed(["a", "b", "c"], 1, "v0001")
    assert not isinstance(info.value, DuplicateConsumptionError)
    assert info.value.group_id == "c"
    assert [ledger.get(g).state for g in "abc"] == ["admitted", "admitted", "collected"]
    assert ledger.counts().illegal_transitions_rejected == 1
    with pytest.raises(UnknownGroupError):
        ledger.mark_consumed(["a", "zzz"], 1, "v0001")
    assert ledger.get("a").state == "admitted"


def test_illegal_transitions(ledger: Ledger) -> None:
    collected(ledger, "g")
    ledger.discard("g", "incomplete_group")
    for call in (lambda: ledger.admit("g"), lambda: ledger.quarantine("g", "x"),
                 lambda: ledger.mark_consumed(["g"], 1, "v1")):
        with pytest.raises(IllegalTransitionError):
            call()
    assert ledger.get("g").state == "discarded"
    with pytest.raises(LedgerError):
        ledger.quarantine("g", " ")
    with pytest.raises(LedgerError):
        ledger.mark_consumed([], -1, "v1")
    with pytest.raises(UnknownGroupError):
        ledger.get("nope")


def test_duplicate_collection_refused(ledger: Ledger) -> None:
    collected(ledger, "g")
    with pytest.raises(DuplicateGroupError):
        collected(ledger, "g")
    assert ledger.counts().duplicate_collections_rejected == 1
    assert ledger.counts().total == 1


def test_exactly_once_report_counts_categories_separately(ledger: Ledger) -> None:
    admitted(ledger, "ok1", "ok2", "pend", "extra")
    ledger.record_collected(lease("short"), Summary(n_trajectories=3))
    ledger.discard("short", "incomplete_group")
    collected(ledger, "stale")
    ledger.quarantine("stale", "stale_policy")
    ledger.mark_consumed(["ok1", "ok2", "extra"], 1, "v0001")
    with pytest.raises(DuplicateConsumptionError):
        ledger.mark_consumed(["ok1"], 2, "v0002")
    report = ledger.exactly_once_report(["ok1", "ok2", "pend", "short", "stale", "lost"])
    assert report.consumed_once == ("ok1", "ok2")
    assert report.duplicate == ("ok1",) and report.duplicate_attempts == 1
    assert report.lost == ("lost",)
    assert report.incomplete == ("short",) and report.discarded == ("short",)
    assert report.quarantined == ("stale",)
    assert report.pending == ("pend",)
    assert report.unexpected == ("extra",)
    assert not report.ok
    assert ledger.counts().incomplete == 1
    assert ledger.exactly_once_report(["ok1", "ok2", "extra"]).ok


def test_reconcile_marks_checkpointed_and_reverts_unsaved(ledger: Ledger) -> None:
    admitted(ledger, "a", "b", "c", "d")
    ledger.mark_consumed(["a"], 1, "v0001")
    # Checkpoint step 2 committed {a, b} but the crash hit before the ledger heard of b.
    report = ledger.reconcile_with_checkpoint({"a", "b"}, step=2, output_policy_version="v0002")
    assert report.marked_consumed == ("b",) and report.reverted_to_admitted == ()
    assert ledger.get("b").consumed_step == 2
    # The ledger then recorded step 3 {c}, but the restored checkpoint is step 2.
    ledger.mark_consumed(["c"], 3, "v0003")
    report = ledger.reconcile_with_checkpoint({"a", "b"}, step=2)
    assert report.reverted_to_admitted == ("c",)
    row = ledger.get("c")
    assert (row.state, row.consumed_step, row.output_policy_version) == ("admitted", None, None)
    assert ledger.counts().reverted_by_reconcile == 1
    ledger.mark_consumed(["c"], 3, "v0003")  # re-applied exactly once
    assert ledger.reconcile_with_checkpoint({"a", "b", "c"}, 3).marked_consumed == ()


def test_reconcile_inconsistencies_raise_and_change_nothing(ledger: Ledger) -> None:
    admitted(ledger, "a", "b")
    collected(ledger, "q")
    ledger.quarantine("q", "stale_policy")
    ledger.mark_consumed(["a"], 1, "v0001")
    for ids, step in (({"a", "q"}, 1), ({"a", "ghost"}, 1), (set(), 1), ({"b"}, 2)):
        with pytest.raises(LedgerInconsistencyError):
            ledger.reconcile_with_checkpoint(ids, step)
    assert [ledger.get(g).state for g in "abq"] == ["consumed", "admitted", "quarantined"]


def test_persistence_pragmas_and_schema_version(tmp_path: Path) -> None:
    path = tmp_path / "l.sqlite"
    with Ledger(path) as led:
        admitted(led, "g")
        led.mark_consumed(["g"], 4, "v0004")
        mode = led._conn.execute("PRAGMA journal_mode").fetchone()[0]
        sync = led._conn.execute("PRAGMA synchronous").fetchone()[0]
    assert (mode, sync) == ("wal", 2)  # 2 == FULL
    with Ledger(path) as led:
        assert led.get("g").consumed_step == 4
    con = sqlite3.connect(path)
    con.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
    con.commit()
    con.close()
    with pytest.raises(LedgerSchemaError):
        Ledger(path)


def test_concurrent_consumers_consume_once(tmp_path: Path) -> None:
    path = tmp_path / "l.sqlite"
    with Ledger(path) as led:
        admitted(led, *(f"g{i}" for i in range(20)))
    wins: list[str] = []
    lock = threading.Lock()

    def worker(name: str) -> None:
        with Ledger(path) as mine:
            for i in range(20):
                try:
                    mine.mark_consumed([f"g{i}"], i + 1, "v0001")
                except DuplicateConsumptionError:
                    continue
                with lock:
                    wins.append(f"g{i}")

    threads = [threading.Thread(target=worker, args=(f"w{k}",)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(wins) == sorted(f"g{i}" for i in range(20))
    with Ledger(path) as led:
        c = led.counts()
        assert c.consumed == 20 and c.duplicate_consumptions_rejected == 40


_OPS = st.lists(st.tuples(st.sampled_from(["collect", "admit", "quarantine", "discard",
                                           "consume"]), st.integers(0, 3)), max_size=30)
_NEXT = {("admit", "collected"): "admitted", ("quarantine", "collected"): "quarantined",
         ("quarantine", "admitted"): "quarantined", ("discard", "collected"): "discarded",
         ("discard", "admitted"): "discarded", ("consume", "admitted"): "consumed"}


@settings(max_examples=40, deadline=None)
@given(ops=_OPS)
def test_state_machine_matches_reference_model(tmp_path_factory: pytest.TempPathFactory,
                                               ops: list[tuple[str, int]]) -> None:
    model: dict[str, str] = {}
    with Ledger(tmp_path_factory.mktemp("sm") / "l.sqlite") as led:
        for op, k in ops:
            gid = f"g{k}"
            expected = (None if gid in model else "collected") if op == "collect" \
                else _NEXT.get((op, model.get(gid, "")))
            call = {"collect": lambda g=gid: collected(led, g),
                    "admit": lambda g=gid: led.admit(g),
                    "quarantine": lambda g=gid: led.quarantine(g, "r"),
                    "discard": lambda g=gid: led.discard(g, "r"),
                    "consume": lambda g=gid: led.mark_consumed([g], 1, "v1")}[op]
            if expected is None:
                with pytest.raises(LedgerError):
                    call()
            else:
                call()
                model[gid] = expected
            assert {g: led.get(g).state for g in model} == model
        assert led.counts().consumed == sum(s == "consumed" for s in model.values())
