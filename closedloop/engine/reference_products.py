"""The float32 products of the publication probe's trainer-path reference.

The reference scores the probe's few ids (7 scored positions) through the trainer's modules
with gradients off; its cost is streaming every weight once. ``nn.Linear``'s ``x Wᵀ`` streams
a weight several times slower at a handful of rows than either form below (AMD EPYC, 2
threads, float32, SmolLM2: the whole reference 75 ms with ``x Wᵀ``, 61 ms with ``(W xᵀ)ᵀ``,
35 ms with the frozen weights oneDNN-packed and bound once):

- packed (a scoring-only copy: ``bind_reference_products``, or ``packed=True`` for a block): a
  frozen weight at least ``FP32_PACK_MIN_WIDTH`` wide on both sides is multiplied in oneDNN's
  pre-packed layout, packed once and kept on its module (re-packed when the weight's storage
  or version counter moves). The LoRA factors (a few rows wide, and changed with every
  version) are never packed and stay unmerged, as the trainer computes them;
- otherwise, at most ``FEW_ROWS`` rows: ``(W xᵀ)ᵀ``.

Either form equals ``x Wᵀ`` up to float32 summation order. Linears with another forward bound
(the bf16 rule of ``closedloop.engine.precision``), products with gradients on and products of
more rows keep ``nn.Linear``'s own. The trainer's own model is never bound for good.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from closedloop.engine.llama_decode import (
    FP32_PACK_MIN_WIDTH,
    PACK_ROWS_HINT,
    onednn_fp32_packing,
)

FEW_ROWS = 64
"""Up to this many rows ``(W xᵀ)ᵀ`` is used (it was faster at every count up to 128)."""


def _packed_weight(linear: nn.Linear) -> torch.Tensor:
    """``linear``'s weight in oneDNN's packed layout, made once per storage and version."""
    w = linear.weight
    key = (w.data_ptr(), w._version)
    cached = linear.__dict__.get("_closedloop_packed")
    if cached is None or cached[0] != key:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(),
                                                         PACK_ROWS_HINT)
        cached = linear.__dict__["_closedloop_packed"] = (key, packed)
    return cached[1]


def _packs(linear: nn.Linear) -> bool:
    return (not linear.weight.requires_grad and min(linear.weight.shape) >= FP32_PACK_MIN_WIDTH
            and onednn_fp32_packing())


def _reference_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled():
        return nn.functional.linear(x, self.weight, self.bias)
    if self.__dict__["_closedloop_pack"]:
        y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), _packed_weight(self), None,
                                               "none", [], "")
    elif x2.shape[0] <= FEW_ROWS:
        y = torch.mm(self.weight, x2.t()).t()
    else:
        return nn.functional.linear(x, self.weight, self.bias)
    if self.bias is not None:
        y = y + self.bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _linears(model: Any) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)
            and "forward" not in m.__dict__ and m.weight.dtype == torch.float32]


def _bind(linear: nn.Linear, packed: bool) -> None:
    linear.__dict__["_closedloop_pack"] = packed and _packs(linear)
    linear.forward = types.MethodType(_reference_forward, linear)  # type: ignore[method-assign]


@contextlib.contextmanager
def reference_products(model: Any, packed: bool = False) -> Iterator[None]:
    """Inside the block every float32 ``nn.Linear`` of ``model`` running its own forward
    computes its no-grad products as the module doc says; ``packed`` allows the packed form
    (it keeps a packed copy of each frozen weight on its module)."""
    linears = _linears(model)
    for m in linears:
        _bind(m, packed)
    try:
        yield
    finally:
        for m in linears:
            del m.forward
            del m.__dict__["_closedloop_pack"]


def bind_reference_products(model: Any) -> None:
    """Bind the packed form to ``model``'s float32 Linears for good (once; later calls do
    nothing): for a copy held for scoring only, such as the publisher's reference copy, which
    then pays neither the walk over its modules nor the binding on each call (~9 ms a call on
    SmolLM2)."""
    if model.__dict__.get("_closedloop_reference_bound"):
        return
    for m in _linears(model):
        _bind(m, True)
    model.__dict__["_closedloop_reference_bound"] = True
