"""A LoRA projection's adapted product in one GEMM: ``addmm(W x, A x, B^T, alpha=s)``.

peft's ``lora.Linear`` computes ``y = W x + (B (A x)) * s`` as three more passes over the
``[tokens, out]`` output (``B``'s product written, scaled, added to ``W x``) and one more in the
backward (the scale on the incoming gradient). ``FusedLoraLinear`` computes the same

    y = addmm(W x, A x, B^T, alpha=s)      (out = W x + s (A x) B^T, one GEMM accumulating into W x)

and takes ``B^T`` contiguous (``r x out``, a few KB), so that autograd computes ``B``'s gradient
as ``s (A x)^T g``: ``r`` rows streaming the output gradient once, where peft's ``Linear``
computes ``g^T (A x)``, a transposed product with ``r`` columns that MKL runs several times
slower (6.6x at 3,265 ids and 1,536 outputs). The function is peft's; the gradient of ``B`` is
summed in another order (relative differences ~1e-6: tested within float32 tolerances, not
bit for bit). On SmolLM2 with LoRA on all seven projections, a trainer micro-batch of 8
multi-turn episodes (~3,300 ids) runs its forward and backward ~9% faster on a 2-core CPU
(docs/performance.md, "LoRA's products fused").

Only the plain case is fused: one or more vanilla adapters (no DoRA or other variant, no
``lora_B`` bias), adapters enabled and not merged, no extra forward arguments, and every
Linear of the layer running its own float32 forward (under ``closedloop.engine.precision``'s
bf16 rule the factors keep peft's path, so that rule applies to them unchanged). Anything else
falls through to peft's own forward. ``fuse_lora_products`` switches a model's LoRA layers to
this class in place (same parameters, buffers and state-dict names; the class is importable, so
the model still pickles and deep-copies).
"""

from __future__ import annotations

from typing import Any

import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import nn


class FusedLoraLinear(LoraLinear):
    """peft's ``lora.Linear`` with the adapted product fused (module doc)."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``W x + s (A x) B^T`` as one ``addmm`` per adapter; peft's forward when not fusable.

        ``B^T`` is made contiguous so that ``B``'s gradient is ``s (A x)^T g`` (module doc).
        """
        if args or kwargs or not self._fusable():
            return super().forward(x, *args, **kwargs)
        result = self.base_layer(x)
        flat = result.reshape(-1, result.shape[-1])
        for name in self.active_adapters:
            if name not in self.lora_A:
                continue
            down: nn.Linear = self.lora_A[name]  # type: ignore[assignment]
            up: nn.Linear = self.lora_B[name]  # type: ignore[assignment]
            drop: nn.Module = self.lora_dropout[name]
            xa = down(drop(self._cast_input_dtype(x, down.weight.dtype)))
            flat = torch.addmm(flat, xa.reshape(-1, xa.shape[-1]), up.weight.t().contiguous(),
                               alpha=self.scaling[name])
        return flat.view(result.shape)

    def _fusable(self) -> bool:
        if self.disable_adapters or self.merged:
            return False
        if not _plain_float32(self.get_base_layer()):
            return False
        for name in self.active_adapters:
            if name not in self.lora_A:
                continue
            down, up = self.lora_A[name], self.lora_B[name]
            if (name in self.lora_variant or up.bias is not None or not _plain_float32(down)
                    or not _plain_float32(up)):
                return False
        return True


def _plain_float32(linear: Any) -> bool:
    """An ``nn.Linear`` with float32 weights running its own forward (no rule bound to it)."""
    return (isinstance(linear, nn.Linear) and "forward" not in linear.__dict__
            and linear.weight.dtype == torch.float32)


def fuse_lora_products(model: Any) -> int:
    """Switch every peft ``lora.Linear`` of ``model`` to ``FusedLoraLinear`` in place; return
    how many were switched (0 for a model without LoRA layers)."""
    switched = 0
    for module in model.modules():
        if type(module) is LoraLinear:
            module.__class__ = FusedLoraLinear
            switched += 1
    return switched
