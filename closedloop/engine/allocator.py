"""Keep freed tensor memory in the process instead of returning it to the OS (glibc only).

PyTorch's CPU allocator takes every tensor from ``malloc``. glibc serves a block above its
*mmap threshold* with a fresh ``mmap`` and gives it back with ``munmap`` on free, and it trims
the top of the heap whenever more than the *trim threshold* is free. A forward pass makes and
drops the same few-MB activations hundreds of times, so each one is page-faulted and zeroed by
the kernel again (docs/performance.md has the measurements).

``tune_allocator()`` sets, with ``mallopt``:

- ``M_MMAP_THRESHOLD`` = 32 MiB (glibc's maximum): blocks up to 32 MiB come from the heap and
  are reused; larger ones are still mapped and page-faulted anew on every use, which is why
  ``closedloop.engine.vocab_scoring`` projects the vocabulary in slices under it;
- ``M_TRIM_THRESHOLD`` = 1 GiB and ``M_TOP_PAD`` = 256 MiB: freed heap memory stays mapped
  for the next pass.

The cost is resident memory: the process keeps freed blocks, up to its high-water mark,
instead of returning them to the OS; ``release_free_memory()`` gives them back once (glibc's
``malloc_trim``), for a process about to sit idle beside another that needs the memory (a
benchmark's other side). It changes no result, only where bytes come from. The CLI and
the benchmarks call it once at start; a library user may call it too. It is a no-op (with the
reason returned) where libc is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
from typing import Any

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
SETTINGS = {M_MMAP_THRESHOLD: 32 * 2**20, M_TRIM_THRESHOLD: 2**30, M_TOP_PAD: 256 * 2**20}
_NAMES = {M_MMAP_THRESHOLD: "M_MMAP_THRESHOLD", M_TRIM_THRESHOLD: "M_TRIM_THRESHOLD",
          M_TOP_PAD: "M_TOP_PAD"}


def _glibc() -> Any:
    """glibc itself (a ``ctypes.CDLL``), or a string naming the libc this process has instead."""
    libc_name, _ = platform.libc_ver()
    if platform.system() != "Linux" or libc_name != "glibc":
        return f"libc is {libc_name or 'unknown'} on {platform.system()}"
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def tune_allocator() -> dict[str, int] | str:
    """Apply ``SETTINGS`` with glibc's ``mallopt``; return them by name, or why not."""
    libc = _glibc()
    if isinstance(libc, str):
        return f"not tuned: {libc}"
    applied: dict[str, int] = {}
    for option, value in SETTINGS.items():
        if libc.mallopt(ctypes.c_int(option), ctypes.c_int(value)) != 1:
            return f"not tuned: mallopt({_NAMES[option]}, {value}) was refused"
        applied[_NAMES[option]] = value
    return applied


def release_free_memory() -> bool | str:
    """Return the heap's free blocks to the OS now (glibc ``malloc_trim(0)``, whatever the trim
    threshold); whether any memory was released, or why it was not tried."""
    libc = _glibc()
    if isinstance(libc, str):
        return f"not released: {libc}"
    return bool(libc.malloc_trim(ctypes.c_size_t(0)))
