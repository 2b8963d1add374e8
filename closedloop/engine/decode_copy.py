"""The generator's own copy of the policy weights, laid out for decoding.

A rollout engine samples from a *published copy* of the policy, not from the trainer's module
(vLLM and SGLang hold their own weights too). ``DecodeCopy`` is that copy for ``HFGenerator``:

- a vanilla peft LoRA layer is merged: ``W' = W + s B A`` (``get_delta_weight``), so a decode
  step makes 7 matmuls a block instead of 15, and no adapter dispatch;
- every ``nn.Linear`` ``y = x W^T + b`` is stored as ``W^T`` (``[in, out]``, contiguous) and
  computed as ``x @ W^T + b`` (the CPU GEMM reads a pre-transposed weight faster at a few
  rows);
- everything else (embeddings, norms, rotary buffers) is the copy's own tensor, synced by name.

With ``precision="bfloat16"`` (``closedloop.engine.precision``) each layer instead holds the
merged ``W' = W + s B A`` rounded once to bf16 (``Bf16Linear``) and computes
``float32(bf16(x) @ W'^T)``. The trainer rounds ``W`` and runs the factors as separate bf16
matmuls: a different rounding of the same function. Keeping the factors unmerged here would not
make the two paths agree more closely (bf16 rounding flips compound over the layers to the
same gap either way) and would cost a decode step the factor products.

Contract: ``sync()`` copies the policy's *current* weights (call it whenever they change; the
generator does in ``refresh_weights``). After a sync, the copy's logits equal the policy's up to
fp32 rounding of the merge and the kernel choice (bounded by a test; the generator/trainer
log-prob auditor measures the same gap at run time). The copy is never trained, always in eval
mode, and never shares storage with the policy, so an optimizer step cannot leak into sampling
before it is published.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from closedloop.engine.precision import bf16_matmul, check_precision


class TransposedLinear(nn.Module):
    """``y = x @ weight_t + bias`` with ``weight_t`` the ``[in, out]`` transpose of a Linear's."""

    weight_t: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight_t", weight_t.contiguous(), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.clone(), persistent=False)
        self.in_features, self.out_features = weight_t.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layer to ``[..., in]``."""
        y = self.product(x)
        return y if self.bias is None else y + self.bias

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight_t``."""
        return torch.matmul(x, self.weight_t)


class Bf16Linear(TransposedLinear):
    """``y = float32(bf16(x) @ weight_t) + bias``: ``weight_t`` rounded once to bf16."""

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight_t.to(torch.bfloat16), bias)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """``float32(bf16(x) @ weight_t)``."""
        return bf16_matmul(x, self.weight_t)


def is_mergeable_lora(module: nn.Module) -> bool:
    """True for a peft LoRA ``Linear`` wrapper over an ``nn.Linear`` that merges exactly.

    LoRA variants (DoRA, ...) and LoRA biases are left to peft's own forward.
    """
    base = getattr(module, "base_layer", None)
    return (isinstance(base, nn.Linear) and hasattr(module, "get_delta_weight")
            and not getattr(module, "lora_variant", {})
            and not any(getattr(module, "lora_bias", {}).values()))


def effective_weight(module: Any) -> torch.Tensor:
    """The ``[out, in]`` weight a Linear or a mergeable LoRA wrapper applies right now."""
    if isinstance(module, nn.Linear):
        return module.weight.detach()
    weight: torch.Tensor = module.base_layer.weight.detach()
    if getattr(module, "disable_adapters", False) or getattr(module, "merged", False):
        return weight
    for name in module.active_adapters:
        if name in module.lora_A:
            weight = weight + module.get_delta_weight(name).detach()
    return weight


def effective_bias(module: Any) -> torch.Tensor | None:
    """The bias a Linear or a LoRA wrapper (its base layer's) adds, detached; or ``None``."""
    layer = module.base_layer if hasattr(module, "base_layer") else module
    return None if layer.bias is None else layer.bias.detach()


class DecodeCopy:
    """A decode-layout copy of a causal LM (or of a peft model's base); see the module doc."""

    def __init__(self, model: Any, precision: str = "float32") -> None:
        self.precision = check_precision(precision)
        self.source = model.get_base_model() if hasattr(model, "get_base_model") else model
        with torch.no_grad():
            self.model = copy.deepcopy(self.source)
            self._linears = self._replace_linears()
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)

    def __call__(self, **kwargs: Any) -> Any:
        """Run the copy's forward (same keywords as the causal LM's)."""
        return self.model(**kwargs)

    def _replace_linears(self) -> list[str]:
        """Swap every Linear / mergeable LoRA wrapper of the copy for a ``TransposedLinear``
        (``Bf16Linear`` under bfloat16)."""
        names: list[str] = []
        for name, module in list(self.model.named_modules()):
            if not name or not (isinstance(module, nn.Linear) or is_mergeable_lora(module)):
                continue
            if any(name.startswith(done + ".") for done in names):
                continue  # inside a wrapper already replaced
            src = self.source.get_submodule(name)
            bias = effective_bias(module)
            kind = TransposedLinear if self.precision == "float32" else Bf16Linear
            layer = kind(effective_weight(src).t(), bias)
            parent, _, child = name.rpartition(".")
            setattr(self.model.get_submodule(parent) if parent else self.model, child, layer)
            names.append(name)
        return names

    @torch.no_grad()
    def sync(self) -> None:
        """Copy the source's current weights into the copy (merged, transposed)."""
        for name in self._linears:
            dst: Any = self.model.get_submodule(name)
            src: Any = self.source.get_submodule(name)
            dst.weight_t.copy_(effective_weight(src).t())
            bias = effective_bias(src)
            if bias is not None:
                dst.bias.copy_(bias)
        params = dict(self.source.named_parameters())
        buffers = dict(self.source.named_buffers())
        for name, tensor in [*self.model.named_parameters(), *self.model.named_buffers()]:
            if name.rpartition(".")[0] in self._linears:
                continue
            src_t = params.get(name, buffers.get(name))
            if src_t is None:
                raise KeyError(f"decode copy: the policy has no tensor {name!r} to sync")
            tensor.copy_(src_t)
