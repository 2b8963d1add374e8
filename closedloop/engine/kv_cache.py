"""KV-cache plumbing for the batched generator: per-session caches <-> one padded batch cache.

A session's cache is a list over layers of ``(keys, values)``, each ``[1, H_kv, n, D]`` for its
``n`` processed ids, with no padding. ``batch_cache`` left-pads them to a common length ``C`` and
stacks them into one transformers ``DynamicCache`` whose layers (``GrowingKVLayer``) append in
place into a buffer with headroom, so a decode step copies only the new keys/values instead of
re-concatenating the whole cache (``DynamicLayer`` does ``torch.cat`` on every step: ~17% of an
SmolLM2 decode step at batch 8 and 400 cached ids). ``row_cache`` takes one row back out with
the padding squeezed away (a copy of the runs of real positions).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each [1, H, n, D]


class GrowingKVLayer(DynamicLayer):
    """A ``DynamicLayer`` that appends in place into a buffer of capacity >= length.

    ``keys``/``values`` are views ``buffer[:, :, :n]`` (last dim contiguous). The first
    allocation reserves ``reserve`` positions; later growth adds 50% (at least 64).
    """

    def __init__(self, reserve: int = 0) -> None:
        super().__init__()
        self.reserve = reserve
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[B, H, q, D]`` keys/values; return the full ``[B, H, n + q, D]`` views."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, q = self.get_seq_length(), key_states.shape[-2]
        kbuf, vbuf = self._kbuf, self._vbuf
        if kbuf is None or vbuf is None or n + q > kbuf.shape[-2]:
            kbuf, vbuf = self._grow(n, n + q, key_states, value_states)
        kbuf[:, :, n:n + q] = key_states
        vbuf[:, :, n:n + q] = value_states
        self.keys, self.values = kbuf[:, :, :n + q], vbuf[:, :, :n + q]
        return self.keys, self.values

    def hold(self, kbuf: torch.Tensor, vbuf: torch.Tensor, n: int) -> None:
        """Start from buffers whose first ``n`` positions are already the cache."""
        self.lazy_initialization(kbuf, vbuf)
        self._kbuf, self._vbuf = kbuf, vbuf
        self.keys, self.values = kbuf[:, :, :n], vbuf[:, :, :n]

    def _grow(self, n: int, need: int, k_like: torch.Tensor,
              v_like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cap = max(need + max(need // 2, 64), self.reserve)
        b, h, _, d = k_like.shape
        kbuf = k_like.new_empty(b, h, cap, d)
        vbuf = v_like.new_empty(b, h, cap, v_like.shape[-1])
        if n and self.keys is not None and self.values is not None:
            kbuf[:, :, :n] = self.keys
            vbuf[:, :, :n] = self.values
        self._kbuf, self._vbuf = kbuf, vbuf
        return kbuf, vbuf

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only rows ``indices``, in that order (buffers included).

        A selection no larger than the buffer is done in place: the rows whose position changes
        are copied (read out first, then written) and the buffers become views of their first
        ``len(indices)`` rows. With ``hf_generator.compaction_order`` only the rows that fill a
        finished row's slot move, instead of the whole batch being gathered anew. A larger
        selection (a prompt's cache repeated for its siblings) gathers new buffers.
        """
        n = self.get_seq_length()
        kbuf, vbuf = self._kbuf, self._vbuf
        if kbuf is None or vbuf is None or n == 0:
            return
        order = indices.tolist()
        if len(order) <= kbuf.shape[0]:
            moved = [(j, i) for j, i in enumerate(order) if i != j]
            if moved:
                dst = torch.tensor([j for j, _ in moved], device=kbuf.device)
                src = torch.tensor([i for _, i in moved], device=kbuf.device)
                kbuf.index_copy_(0, dst, kbuf.index_select(0, src))
                vbuf.index_copy_(0, dst, vbuf.index_select(0, src))
            self._kbuf, self._vbuf = kbuf[:len(order)], vbuf[:len(order)]
        else:
            self._kbuf, self._vbuf = kbuf[indices], vbuf[indices]
        self.keys, self.values = self._kbuf[:, :, :n], self._vbuf[:, :, :n]


def batch_cache(caches: Sequence[KV | None], c_max: int, reserve: int) -> Any:
    """Left-pad each session cache (``None`` = nothing cached) to ``c_max`` and stack them.

    ``reserve``: total positions to allocate up front (cached + pending + new tokens).
    """
    cache: Any = DynamicCache()
    cache.layer_class_to_replicate = None
    ref = next((kv for kv in caches if kv is not None), None)
    if ref is None or c_max == 0:
        cache.layers = []
        cache.layer_class_to_replicate = _reserving(reserve)
        return cache
    layers = []
    for li in range(len(ref)):
        layer = GrowingKVLayer(reserve)
        layer.hold(_stacked([None if kv is None else kv[li][0] for kv in caches], c_max, reserve),
                   _stacked([None if kv is None else kv[li][1] for kv in caches], c_max, reserve),
                   c_max)
        layers.append(layer)
    cache.layers = layers
    return cache


def _stacked(rows: Sequence[torch.Tensor | None], c_max: int, reserve: int) -> torch.Tensor:
    """A ``[B, H, max(reserve, c_max), D]`` buffer holding each row's ``[1, H, n, D]`` states
    (``None``: none) right-aligned at ``c_max``, zeros to their left: one copy of each row, no
    padded intermediates."""
    ref = next(r for r in rows if r is not None)
    buf = ref.new_empty(len(rows), ref.shape[1], max(reserve, c_max), ref.shape[3])
    for b, row in enumerate(rows):
        n = 0 if row is None else row.shape[2]
        if n < c_max:
            buf[b, :, :c_max - n].zero_()
        if row is not None and n:
            buf[b, :, c_max - n:c_max] = row[0]
    return buf


def row_cache(cache: Any, row: int, mask_L: torch.Tensor) -> KV:
    """Return row ``row`` of a batch cache as a session cache, keeping positions where mask=1.

    The kept positions form at most a few runs (cached ids, then pending + decoded ids), so
    the copy is a concatenation of slices rather than a gather.
    """
    runs = mask_runs(mask_L.tolist())
    out: KV = []
    for layer in cache.layers:
        k, v = layer.keys[row:row + 1], layer.values[row:row + 1]
        out.append((torch.cat([k[:, :, a:b] for a, b in runs], 2),
                    torch.cat([v[:, :, a:b] for a, b in runs], 2)))
    return out


def mask_runs(mask: Sequence[int]) -> list[tuple[int, int]]:
    """Return the ``[start, end)`` runs of ones in a 0/1 sequence, in order."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _reserving(reserve: int) -> Any:
    class _Reserving(GrowingKVLayer):
        def __init__(self) -> None:
            super().__init__(reserve)

    return _Reserving
