"""Float32 products of a few rows, computed as ``(W xᵀ)ᵀ``.

``nn.Linear`` computes ``x Wᵀ`` (MKL's ``sgemm`` with the weight transposed). With a handful of
rows that form streams the weight several times slower than ``W xᵀ`` on the AMD EPYC hosts
this project runs on: SmolLM2's vocabulary head at 7 rows took 21 ms against 6 ms, its 210
layer products 49 ms against 28 (2 threads, float32; the two agree up to float32 summation
order). The publication probe's trainer-path reference scores 7 ids, so it runs its forward
inside ``few_row_products``; the trainer's own forwards (hundreds of rows, with gradients)
keep ``nn.Linear``'s product.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

FEW_ROWS = 64
"""Up to this many rows the ``W xᵀ`` form is used (it was faster at every count up to 128)."""


def _few_rows_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] > FEW_ROWS or torch.is_grad_enabled():
        return nn.functional.linear(x, self.weight, self.bias)
    y = torch.mm(self.weight, x2.t()).t()
    if self.bias is not None:
        y = y + self.bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


@contextlib.contextmanager
def few_row_products(model: Any) -> Iterator[None]:
    """Inside the block, every float32 ``nn.Linear`` of ``model`` running its own forward
    computes a no-grad product of at most ``FEW_ROWS`` rows as ``(W xᵀ)ᵀ`` (module doc);
    Linears with another forward bound (the bf16 rule) are left alone."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)
               and "forward" not in m.__dict__ and m.weight.dtype == torch.float32]
    for m in linears:
        m.forward = types.MethodType(_few_rows_forward, m)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for m in linears:
            del m.forward
