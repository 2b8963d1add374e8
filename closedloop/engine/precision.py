"""Matmul precision of the policy's forward passes: ``float32`` (default) or ``bfloat16``.

The policy's weights are always float32 masters. ``bfloat16`` changes how every Linear layer
(base weights, LoRA factors, the vocabulary head) computes, and nothing else:

    y = float32( bf16(x) @ bf16(W)^T ) [+ b]

(the GEMM accumulates in float32 and returns its result rounded to bf16, which is then widened:
outputs, logits included, carry bf16 precision).

Embeddings, norms, rotary, attention, softmax, residual adds and log-softmax stay float32. On
CPUs with AMX-BF16 a GEMM of a few hundred rows runs ~5x faster in bf16 than in fp32, and a
decode step reads half the weight bytes (docs/concepts.md, precision policy); the price is a policy
that is no longer the fp32 one: a greedy output can change, and log-probs move by O(1e-2).

Both paths that score the policy apply this rule:

- the trainer, with ``matmul_precision(model, "bfloat16")`` around its forward passes (a
  frozen weight's bf16 copy is made once and reused while the weight's storage and version
  counter are unchanged, so an in-place update or a re-assignment is seen, but a write through
  ``.data`` (which bypasses the version counter) needs ``drop_bf16_copies``; a trainable weight
  is cast on every call, inside autograd);
- the generator's decode copy (``DecodeCopy(model, "bfloat16")``), which rounds the merged
  LoRA weight ``W + s B A`` once instead of running the factors separately.

They agree in exact arithmetic, not in bf16: a rounding flip anywhere (a different GEMM
blocking, a different merge) compounds over the layers, and on SmolLM2-135M the two paths
differ by ~1e-1 max / ~2e-2 mean |Δ logp| per action token, about as much as bf16 differs from
fp32 (fp32 paths agree to ~1e-5). That gap is the training-inference mismatch the log-prob
auditor measures; a bf16 run must declare a tolerance for it.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from closedloop.errors import PrecisionError

PRECISIONS = ("float32", "bfloat16")


def check_precision(name: str) -> str:
    """Return ``name`` if it is one of ``PRECISIONS``; raise naming the choices otherwise."""
    if name not in PRECISIONS:
        raise PrecisionError(f"matmul precision must be one of {PRECISIONS}, got {name!r}")
    return name


def precision_label(precision: str, master_dtype: str = "float32") -> str:
    """How a run computes, for manifests and audit records: ``float32`` (plain) or
    ``bfloat16-matmul/float32`` (bf16 matmuls over float32 masters)."""
    check_precision(precision)
    return master_dtype if precision == "float32" else f"{precision}-matmul/{master_dtype}"


def bf16_matmul(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """``float32(bf16(x) @ weight_t)`` with ``weight_t`` already bf16 ``[in, out]``."""
    return torch.matmul(x.to(torch.bfloat16), weight_t).float()


def bf16_weight(linear: nn.Linear) -> torch.Tensor:
    """The bf16 copy of ``linear.weight`` that the bf16 rule multiplies by.

    A trainable weight is cast inside autograd on every call; a frozen one is cast once and
    cached against its storage pointer and version counter. Under ``inference_mode`` nothing is
    cached: the copy would be an inference tensor that a later backward cannot save.
    """
    w = linear.weight
    if w.requires_grad or torch.is_inference_mode_enabled():
        return w.to(torch.bfloat16)
    key = (w.data_ptr(), w._version)
    cached = linear.__dict__.get("_closedloop_bf16")
    if cached is None or cached[0] != key:
        cached = (key, w.detach().to(torch.bfloat16))
        linear.__dict__["_closedloop_bf16"] = cached
    return cached[1]


def _bf16_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The bf16 rule for one ``nn.Linear`` (bound to the module while the context is open)."""
    y = nn.functional.linear(x.to(torch.bfloat16), bf16_weight(self)).float()
    return y if self.bias is None else y + self.bias


def linear_precision(linear: nn.Linear) -> str | None:
    """The precision an ``nn.Linear`` computes in right now: ``float32`` (its own forward),
    ``bfloat16`` (the rule bound by ``matmul_precision``), or ``None`` (another patch)."""
    bound = linear.__dict__.get("forward")
    if bound is None:
        return "float32"
    if getattr(bound, "__func__", None) is _bf16_linear_forward:
        return "bfloat16"
    return None


@contextlib.contextmanager
def matmul_precision(model: Any, precision: str) -> Iterator[None]:
    """Run every ``nn.Linear`` of ``model`` under ``precision`` inside the block.

    ``float32`` changes nothing. ``bfloat16`` binds the module doc's rule to each Linear for
    the duration of the block (autograd graphs built inside keep it for their backward) and
    restores the plain forward on exit, even on error.
    """
    check_precision(precision)
    if precision == "float32":
        yield
        return
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)
               and "forward" not in m.__dict__]
    for m in linears:
        m.forward = types.MethodType(_bf16_linear_forward, m)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for m in linears:
            del m.forward


def drop_bf16_copies(model: Any) -> None:
    """Forget the cached bf16 copies of frozen weights (they are rebuilt on next use)."""
    for m in model.modules():
        m.__dict__.pop("_closedloop_bf16", None)
