"""Phase timing: each phase records its seconds and the process's memory at its end."""

from __future__ import annotations

import sys

import pytest

from closedloop.progress import memory_gb, phase, phase_lines, phase_times, reset_phases


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_phase_records_the_memory_held_and_the_peak_so_far() -> None:
    reset_phases()
    with phase("outer"):
        block = bytearray(64 * 2**20)  # 64 MiB, touched so it is resident
        block[::4096] = b"x" * len(block[::4096])
        with phase("inner"):
            pass
        held_inside = memory_gb()[0]
        del block
    inner, outer = sorted(phase_times(), key=lambda p: p["depth"], reverse=True)
    assert inner["phase"] == "inner" and outer["phase"] == "outer"
    for p in (inner, outer):
        assert p["seconds"] >= 0 and p["rss_gb"] > 0 and p["peak_rss_gb"] >= p["rss_gb"] * 0.99
    assert held_inside is not None and inner["peak_rss_gb"] >= held_inside * 0.99
    assert outer["peak_rss_gb"] >= inner["peak_rss_gb"]  # a peak never falls
    lines = phase_lines(phase_times())
    assert "peak" in lines[0] and "held" in lines[0] and lines[1].startswith("  inner")
    reset_phases()


def test_phase_lines_read_records_without_memory() -> None:
    """Results written before memory was recorded still print."""
    assert phase_lines([{"phase": "arm rloo", "depth": 0, "seconds": 12.4}]) == [
        f"{'arm rloo':<40} 12 s"]
