"""``frozen_objects``: the objects alive when a run opens stay out of the collector's walks
while it is open, and a reference cycle among them that becomes garbage is collected after."""

from __future__ import annotations

import gc
import weakref

from closedloop.training.frozen_objects import frozen_objects


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> tuple[_Node, weakref.ref[_Node]]:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return a, weakref.ref(b)


def test_garbage_before_the_block_is_collected_at_entry() -> None:
    a, alive = _cycle()
    del a
    with frozen_objects():
        assert alive() is None
    assert gc.get_freeze_count() == 0


def test_frozen_cycles_wait_for_the_outermost_exit() -> None:
    a, alive = _cycle()
    with frozen_objects() as frozen:
        assert frozen > 0 and gc.get_freeze_count() > 0
        del a  # a cycle among frozen objects becomes garbage inside the block
        gc.collect()
        assert alive() is not None  # frozen: no collection walks it
        with frozen_objects():
            pass
        assert gc.get_freeze_count() > 0  # the inner exit leaves the outer block frozen
        b, b_alive = _cycle()
        del b
        gc.collect()
        assert b_alive() is None  # what the block allocates is collected as usual
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None
