"""``write_uncached``: any payload lands whole and exact, around the page cache where the file
system allows and through it where it does not."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from closedloop.policy import uncached_write
from closedloop.policy.uncached_write import BLOCK, write_uncached

EDGES = [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK, 5 * BLOCK + 17]


@settings(max_examples=40, deadline=None)
@given(st.one_of(st.sampled_from(EDGES), st.integers(0, 6 * BLOCK)), st.integers(0, 255))
def test_any_payload_reads_back_exactly(tmp_path_factory: pytest.TempPathFactory, n: int,
                                        fill: int) -> None:
    path = tmp_path_factory.mktemp("w") / "f"
    path.write_bytes(b"an older and longer content " * 1000)  # replaced whole, not overlaid
    data = bytes((fill + i) % 256 for i in range(n))
    write_uncached(path, data)
    assert path.read_bytes() == data


def test_a_larger_payload_after_a_smaller_one_grows_the_buffer(tmp_path: Path) -> None:
    small, large = os.urandom(10), os.urandom(7 * BLOCK + 3)
    write_uncached(tmp_path / "a", small)
    write_uncached(tmp_path / "b", large)
    write_uncached(tmp_path / "c", small)
    assert [(tmp_path / n).read_bytes() for n in "abc"] == [small, large, small]


def test_where_the_file_system_refuses_o_direct_it_writes_through_the_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not getattr(os, "O_DIRECT", 0):
        pytest.skip("this OS has no O_DIRECT: every write takes the buffered path")
    real_open = os.open

    def refuse(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(uncached_write.os, "open", refuse)
    data = os.urandom(BLOCK + 5)
    assert write_uncached(tmp_path / "f", data) is False
    assert (tmp_path / "f").read_bytes() == data


def test_a_device_that_refuses_the_aligned_write_falls_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not getattr(os, "O_DIRECT", 0):
        pytest.skip("this OS has no O_DIRECT")

    def refuse(fd: int, data: object) -> int:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(uncached_write.os, "write", refuse)
    data = os.urandom(100)
    assert write_uncached(tmp_path / "f", data) is False
    monkeypatch.undo()
    assert (tmp_path / "f").read_bytes() == data


def test_other_errors_are_not_swallowed(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        write_uncached(tmp_path / "missing" / "f", b"x")


def test_where_the_file_system_takes_o_direct_the_bytes_bypass_the_cache(tmp_path: Path) -> None:
    flag = getattr(os, "O_DIRECT", 0)
    try:
        os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | flag, 0o644))
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")
    if not flag:
        pytest.skip("this OS has no O_DIRECT")
    assert write_uncached(tmp_path / "f", b"x" * 10) is True
