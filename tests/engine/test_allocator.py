"""The allocator tuning: applied through glibc's mallopt where there is one, refused cleanly
elsewhere, and results unchanged by it."""

import platform

import pytest
import torch

from closedloop.engine import allocator


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_glibc_takes_every_setting():
    got = allocator.tune_allocator()
    assert got == {"M_MMAP_THRESHOLD": 32 * 2**20, "M_TRIM_THRESHOLD": 2**30,
                   "M_TOP_PAD": 256 * 2**20}
    assert all(0 < v < 2**31 for v in got.values())  # mallopt takes a C int


def test_another_libc_is_left_alone(monkeypatch):
    monkeypatch.setattr(allocator.platform, "libc_ver", lambda: ("musl", "1.2"))
    assert allocator.tune_allocator().startswith("not tuned: libc is musl")


def test_a_refused_option_is_reported(monkeypatch):
    class _Libc:
        @staticmethod
        def mallopt(option, value):
            return 0

    monkeypatch.setattr(allocator.platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(allocator.platform, "system", lambda: "Linux")
    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda name: _Libc())
    assert "was refused" in allocator.tune_allocator()


def test_tensors_compute_the_same_after_tuning():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(300, 700, generator=g), torch.randn(700, 900, generator=g)
    before = torch.nn.functional.silu(a @ b).sum(dim=0)
    allocator.tune_allocator()
    for _ in range(3):  # blocks freed and reused from the heap now
        after = torch.nn.functional.silu(a @ b).sum(dim=0)
        assert torch.equal(after, before)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_heap_goes_back_to_the_os_on_request():
    allocator.tune_allocator()  # freed blocks now stay in the heap (1 GiB trim threshold)
    blocks = [torch.ones(2**20) for _ in range(64)]  # 4 MiB each: heap, not mmap
    del blocks
    assert allocator.release_free_memory() is True  # 256 MiB of free heap was handed back
    assert torch.ones(3).sum().item() == 3.0


def test_another_libc_keeps_its_memory(monkeypatch):
    monkeypatch.setattr(allocator.platform, "libc_ver", lambda: ("musl", "1.2"))
    assert allocator.release_free_memory().startswith("not released: libc is musl")
