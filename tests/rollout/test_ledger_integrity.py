"""Ledger integrity: SQLite's own check, rows against their events, and the digest of the
committed rows a checkpoint carries (flipped bytes, truncation, edits, a deleted file)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from closedloop.rollout.ledger import GroupSummary as Summary
from closedloop.rollout.ledger import Ledger, LedgerCorruptError
from closedloop.rollout.ledger_check import LedgerDigest
from tests.rollout.test_ledger import admitted, collected, lease


def filled(path: Path, n: int = 12) -> LedgerDigest:
    """A closed ledger with n consumed groups; the digest taken after the first n - 2."""
    with Ledger(path) as ledger:
        ids = [f"s{i:04d}-g0-{'x' * 40}" for i in range(n)]
        admitted(ledger, *ids[:-2])
        ledger.mark_consumed(ids[:-2], 1, "v0001")
        digest = ledger.digest()
        admitted(ledger, *ids[-2:])  # rows added after the checkpoint are allowed
        ledger.mark_consumed(ids[-2:], 2, "v0002")
    return digest


def test_a_sound_ledger_verifies_with_and_without_a_digest(tmp_path: Path) -> None:
    digest = filled(tmp_path / "ledger.sqlite")
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        ledger.verify()
        ledger.verify(digest)
        assert LedgerDigest.from_dict(digest.to_dict()) == digest
        assert ledger.digest().events_upto > digest.events_upto


def test_flipped_bytes_inside_a_committed_row_are_found(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    digest = filled(path)
    data = bytearray(path.read_bytes())
    at = data.find(b"task-s0003")  # inside the lease_json of a row the digest covers
    assert at > 0
    data[at:at + 16] = bytes(b ^ 0x20 for b in data[at:at + 16])  # 16 bytes flipped
    path.write_bytes(bytes(data))
    with Ledger(path) as ledger, pytest.raises(LedgerCorruptError) as info:
        ledger.verify(digest)
    assert str(path) in str(info.value)


def test_a_state_edited_behind_the_events_is_found_without_a_digest(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    filled(path)
    conn = sqlite3.connect(path)
    conn.execute("UPDATE groups SET state='admitted', consumed_step=NULL WHERE seq=3")
    conn.commit()
    conn.close()
    with Ledger(path) as ledger, pytest.raises(LedgerCorruptError, match="its events say"):
        ledger.verify()


def test_a_ledger_cut_in_half_is_a_named_error_not_a_sqlite_traceback(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as ledger:  # enough rows for several pages
        collected(ledger, *[f"g{i}-{'y' * 200}" for i in range(200)])
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(LedgerCorruptError) as info, Ledger(path) as ledger:
        ledger.verify()
    assert str(path) in str(info.value)
    path.write_bytes(b"not a database at all, just text" * 200)
    with pytest.raises(LedgerCorruptError, match="SQLite cannot open it"):
        Ledger(path)


def test_a_deleted_ledger_does_not_match_the_checkpoint_digest(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    digest = filled(path)
    path.unlink()
    with Ledger(path) as ledger, pytest.raises(LedgerCorruptError, match="rows were committed"):
        ledger.verify(digest)


def test_a_forged_lease_is_found(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as ledger:
        ledger.record_collected(lease("g1"), Summary(n_trajectories=4))
    conn = sqlite3.connect(path)
    conn.execute("UPDATE groups SET lease_json=replace(lease_json, '\"seed\":1', '\"seed\":2')")
    conn.commit()
    conn.close()
    with Ledger(path) as ledger, pytest.raises(LedgerCorruptError, match="lease_hash"):
        ledger.verify()


def test_only_the_digest_sees_a_clean_sql_edit_of_a_committed_summary(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    digest = filled(path)
    conn = sqlite3.connect(path)
    conn.execute("UPDATE groups SET summary_json='{\"n_trajectories\": 1}' WHERE seq=2")
    conn.commit()
    conn.close()
    with Ledger(path) as ledger:
        ledger.verify()  # self-consistent: SQLite and the row checks see nothing
        with pytest.raises(LedgerCorruptError, match=r"groups: rows 1\.\.10 do not match"):
            ledger.verify(digest)
