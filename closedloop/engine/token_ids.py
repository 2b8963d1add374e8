"""Token ids as a generator accepts them: plain ints inside the vocabulary."""

from __future__ import annotations

from collections.abc import Sequence

from closedloop.errors import GenerationError

__all__ = ["checked_token_ids"]


def checked_token_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    """``ids`` as a list of ints; ``GenerationError`` when one lies outside ``[0, vocab_size)``."""
    out = [int(i) for i in ids]
    if any(i < 0 or i >= vocab_size for i in out):
        raise GenerationError(f"token ids must be in [0, {vocab_size})")
    return out
