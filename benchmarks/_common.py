"""Shared helpers of the benchmarks: the machine label, medians, the summary hand-off.

Every benchmark prints ratios measured side by side in one process (modes alternated A, B, A,
B, ...; medians reported) plus absolute figures labelled with the machine, since the shared host
drifts between runs. ``--summary PATH`` makes a benchmark append its headline rows as JSON
lines, which ``run_all.py`` collects into one table.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def machine_label(when: str = "at start", device: str = "cpu") -> str:
    """Platform, CPU count, torch threads, the device the figures were measured on (``cpu``,
    or ``cuda:<name>``) and the load average when called."""
    try:
        import torch

        threads = str(torch.get_num_threads())
        torch_v = torch.__version__
        where = (f"cuda:{torch.cuda.get_device_name()}" if device == "cuda"
                 and torch.cuda.is_available() else "cpu")
    except ImportError:  # pragma: no cover - the TRL venv always has torch
        threads, torch_v, where = "?", "?", device
    load = "/".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{platform.platform()}, python {platform.python_version()}, torch {torch_v}, "
            f"{os.cpu_count()} cpus, torch threads {threads}, device {where}, load avg {when} "
            f"{load}")


def set_threads(threads: int) -> None:
    """Prepare the process as the ``closedloop`` command does: tune the allocator
    (``closedloop.engine.allocator``, printed), then set torch's intra-op threads (0 leaves the
    default)."""
    import torch

    from closedloop.engine import tune_allocator

    print(f"[bench] allocator: {tune_allocator()}")
    if threads:
        torch.set_num_threads(threads)


def resident_gib() -> float | None:
    """This process's resident memory (GiB, Linux ``/proc``), or ``None`` elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        return None
    return None


def give_back_free_memory(label: str) -> None:
    """Before the other side of a benchmark runs in its own process: return this process's
    freed heap to the OS (``closedloop.engine.release_free_memory``; the tuned allocator keeps
    it otherwise) so both fit in memory, and print the resident memory before and after."""
    from closedloop.engine import release_free_memory

    before = resident_gib()
    released = release_free_memory()
    after = resident_gib()
    if before is not None and after is not None:
        print(f"[{label}] this process before the other side: resident {before:.1f} GiB, "
              f"{after:.1f} GiB after returning its free heap ({released})", flush=True)


def median(values: Sequence[float]) -> float:
    """The median (of possibly one value)."""
    return float(statistics.median(values))


def rotate(modes: Sequence[Any], rep: int) -> list[Any]:
    """The modes in rotated order for repeat ``rep`` (drift hits every mode alike)."""
    k = rep % len(modes)
    return list(modes[k:]) + list(modes[:k])


def emit(summary: str | None, bench: str, name: str, value: float | str, unit: str = "",
         target: str = "") -> None:
    """Append one headline row to the summary file (if any)."""
    if not summary:
        return
    row = {"bench": bench, "name": name, "value": value, "unit": unit, "target": target}
    with Path(summary).open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(row) + "\n")
