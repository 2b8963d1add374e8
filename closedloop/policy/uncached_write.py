"""Write a file durably without passing its bytes through the page cache (``O_DIRECT``).

A buffered write copies every byte into page-cache pages the kernel must first find: on a
virtual machine whose host takes back the guest's free memory (a balloon with free page
reporting), each such page costs a host fault, ~9 µs, and a 13 MB checkpoint ~30 ms before its
``fsync`` (docs/performance.md, "Checkpoints written around the page cache"). ``O_DIRECT`` sends
the bytes from an aligned buffer of the process's own straight to the device: the same 13 MB
take ~9 ms, fsync included, whatever the page cache holds, and the file's later reads come
from the device.

``write_uncached`` copies ``data`` into one page-aligned buffer kept for the process (grown as
needed), writes whole blocks, cuts the file to ``len(data)`` and fsyncs it. Where the OS or the
file system refuses ``O_DIRECT`` (tmpfs, macOS) it writes through the page cache and fsyncs
(``closedloop.policy.registry.write_durably``): the file is durable either way.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from pathlib import Path

from closedloop.policy.registry import write_durably

__all__ = ["BLOCK", "write_uncached"]

BLOCK = 4096
"""Alignment of the buffer, the offsets and the lengths ``O_DIRECT`` is given (a multiple of
every block size a Linux file system uses)."""

_buffer: mmap.mmap | None = None
_lock = threading.Lock()


def write_uncached(path: Path, data: bytes | memoryview) -> bool:
    """Create (or replace the content of) ``path`` with ``data`` and fsync it; whether the
    bytes bypassed the page cache (``False``: the buffered fallback ran)."""
    flag = getattr(os, "O_DIRECT", 0)
    if flag:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
        else:
            try:
                if _write_direct(fd, data):
                    return True
            finally:
                os.close(fd)
    write_durably(path, bytes(data))
    return False


def _write_direct(fd: int, data: bytes | memoryview) -> bool:
    """Write ``data`` through ``fd`` (opened ``O_DIRECT``) and fsync; False where the device
    refused the aligned write (nothing is left half-written that the fallback does not
    replace: it truncates)."""
    global _buffer
    n = len(data)
    padded = -(-max(n, 1) // BLOCK) * BLOCK
    with _lock:
        if _buffer is None or len(_buffer) < padded:
            size = max(padded, 2 * len(_buffer)) if _buffer is not None else padded
            if _buffer is not None:
                _buffer.close()
            _buffer = mmap.mmap(-1, size)
        view = memoryview(_buffer)
        try:
            view[:n] = data
            view[n:padded] = bytes(padded - n)
            done = 0
            while done < padded:
                try:
                    wrote = os.write(fd, view[done:padded])
                except OSError as exc:
                    if exc.errno == errno.EINVAL and done == 0:
                        return False
                    raise
                if wrote <= 0 or wrote % BLOCK:
                    raise OSError(errno.EIO, f"an O_DIRECT write stopped at {done + wrote} "
                                  f"of {padded} bytes")
                done += wrote
        finally:
            view.release()
    os.ftruncate(fd, n)
    os.fsync(fd)
    return True
