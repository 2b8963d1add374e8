"""Progress for long work: a tqdm bar with rate and ETA on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import IO


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
