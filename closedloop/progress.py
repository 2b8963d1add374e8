"""Progress for long work: a tqdm bar with rate and ETA on a terminal, plain lines otherwise."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import IO, Any


class Progress:
    """Count units of work; ``update(n)`` after each batch. Use as a context manager."""

    def __init__(self, total: int, desc: str, unit: str = "ep",
                 stream: IO[str] | None = None) -> None:
        self.total = total
        self.desc = desc
        self.unit = unit
        self.stream = stream or sys.stderr
        self.done = 0
        self._start = time.perf_counter()
        self._last_pct = -1
        self._bar = None
        if self.stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream,
                             dynamic_ncols=True)

    def update(self, n: int = 1) -> None:
        """Record ``n`` more units done."""
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        pct = int(100 * self.done / self.total) if self.total else 100
        if pct // 10 > self._last_pct // 10 or self.done == self.total:
            self._last_pct = pct
            elapsed = time.perf_counter() - self._start
            rate = self.done / elapsed if elapsed > 0 else 0.0
            eta = (self.total - self.done) / rate if rate > 0 else float("nan")
            print(f"[{self.desc}] {self.done}/{self.total} {self.unit} ({pct}%) "
                  f"{rate:.2f} {self.unit}/s, eta {eta:.0f}s", file=self.stream, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.close()


def log(message: str) -> None:
    """Print a timestamped status line to stderr."""
    print(f"[closedloop {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


_PHASES: list[dict[str, Any]] = []
_DEPTH = [0]


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Time a phase of this process's work (nested phases are indented under their parent);
    ``phase_times`` lists every phase timed since ``reset_phases``, in start order, each with
    the process's memory when it ended: ``peak_rss_gb``, the most resident memory the process
    has held so far (so the first phase whose peak jumps is the one that set it), and
    ``rss_gb``, what it still held (``memory_gb``)."""
    entry: dict[str, Any] = {"phase": name, "depth": _DEPTH[0], "seconds": None}
    _PHASES.append(entry)
    _DEPTH[0] += 1
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _DEPTH[0] -= 1
        entry["seconds"] = time.perf_counter() - t0
        entry["rss_gb"], entry["peak_rss_gb"] = memory_gb()


def memory_gb() -> tuple[float | None, float | None]:
    """``(resident now, peak resident so far)`` of this process in GB (10^9 bytes); ``None``
    where the platform does not say (resident now is read from ``/proc/self/statm``)."""
    now = peak = None
    try:
        import resource

        # ru_maxrss is in KiB on Linux, in bytes on macOS
        scale = 1 if sys.platform == "darwin" else 1024
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 1e9
    except (ImportError, OSError):
        pass
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        now = pages * os.sysconf("SC_PAGE_SIZE") / 1e9
    except (OSError, ValueError, IndexError):
        pass
    return now, peak


def phase_times() -> list[dict[str, Any]]:
    """The phases timed since ``reset_phases`` (``phase``, ``depth``, ``seconds``)."""
    return [dict(p) for p in _PHASES]


def reset_phases() -> None:
    """Forget the phases timed so far (at the start of a command)."""
    _PHASES.clear()
    _DEPTH[0] = 0


def phase_lines(phases: list[dict[str, Any]]) -> list[str]:
    """The phases as indented ``name  seconds`` lines, with the memory at each one's end
    (``held X GB, peak Y GB``) where it was recorded."""
    return [f"{'  ' * int(p['depth'])}{p['phase']:<{40 - 2 * int(p['depth'])}} "
            f"{p['seconds'] if p['seconds'] is None else round(p['seconds'])} s"
            + _memory_text(p) for p in phases]


def _memory_text(p: dict[str, Any]) -> str:
    held, peak = p.get("rss_gb"), p.get("peak_rss_gb")
    parts = ([f"held {held:.1f} GB"] if held is not None else []) + (
        [f"peak {peak:.1f} GB"] if peak is not None else [])
    return f"  ({', '.join(parts)})" if parts else ""
