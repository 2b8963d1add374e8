"""Keep Python's cyclic garbage collector off the objects a run was set up with.

Before its first step a run holds ~460k objects the collector tracks (torch, transformers, the
model's modules, tokenizer, tasks). A full (generation-2) collection walks every one of them:
0.1–0.2 s on a 2-core CPU, about once every RL step or two, inside whatever the step was doing
at that moment (docs/performance.md, "The collector's pauses"). ``frozen_objects()`` collects
once, then moves every live object into the collector's permanent generation (``gc.freeze``)
for as long as the run is open: later collections walk only what the run allocates after.

Nothing changes for memory that reference counting frees (tensors, records, most garbage);
only a reference cycle among the frozen objects that becomes garbage while the run is open
waits until exit, where ``gc.unfreeze`` hands the frozen objects back to the oldest generation.
Nested uses (a run opened inside another) unfreeze at the outermost exit.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["frozen_objects"]

_lock = threading.Lock()
_depth = 0


@contextmanager
def frozen_objects() -> Iterator[int]:
    """Collect, freeze every live object for the block, unfreeze at the outermost exit.
    Yields the number of objects frozen (``gc.get_freeze_count()``)."""
    global _depth
    with _lock:
        if _depth == 0:
            gc.collect()
            gc.freeze()
        _depth += 1
    try:
        yield gc.get_freeze_count()
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.unfreeze()
