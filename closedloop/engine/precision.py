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

**One bf16 copy of an input, shared by its projections.** q/k/v (and their LoRA ``A``
factors, which read the same input) and gate/up read one hidden state; under the rule each
would cast it to bf16 on its own (per decoder layer, 14 input casts where 4 are distinct).
Inside a ``matmul_precision`` block the two most recently used input casts are kept (the
input tensor itself, its version counter, its bf16 copy: two, because a LoRA ``B`` factor's
input comes between q's and k's) and a Linear whose input is one of those tensors,
unmodified, takes the copy instead of casting again. Each use gets its own autograd node
(``_SharedBf16Cast``) whose backward widens the incoming gradient to float32, exactly as
``x.to(bf16)``'s own backward does, so the input's gradients still sum in float32 and the
forward and backward are bit-identical to one cast per Linear (tested); only the copying is
saved. ``float32`` is untouched.

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
import threading
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


class _SharedBf16Cast(torch.autograd.Function):
    """One use of a shared bf16 copy ``xb`` of ``x``: forward returns a view of ``xb`` (no
    copy); backward widens the gradient to float32 for ``x``, as ``x.to(bf16)`` does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, xb: torch.Tensor) -> torch.Tensor:
        return xb.view_as(xb)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(torch.float32), None


CastEntry = tuple[torch.Tensor, int, torch.Tensor]
"""A kept input cast: the input, its version counter when cast, its detached bf16 copy."""
KEPT_CASTS = 2


class _CastSlot(threading.local):
    """The input casts kept inside a ``matmul_precision`` block, per thread, most recently
    used first (``share`` False: none are kept)."""

    depth: int = 0
    share: bool = False
    entries: tuple[CastEntry, ...] = ()


_SLOT = _CastSlot()


def shared_bf16_input(x: torch.Tensor) -> torch.Tensor:
    """``bf16(x)``, cast once for nearby Linears that read the same unmodified ``x`` (the
    module doc's sharing; outside a sharing block, a plain cast)."""
    if not _SLOT.share or x.dtype != torch.float32:
        return x.to(torch.bfloat16)
    found = next((e for e in _SLOT.entries if e[0] is x and e[1] == x._version), None)
    entry = found or (x, x._version, x.detach().to(torch.bfloat16))
    _SLOT.entries = (entry, *(e for e in _SLOT.entries if e is not entry))[:KEPT_CASTS]
    xb = entry[2]
    if x.requires_grad and torch.is_grad_enabled():
        out: torch.Tensor = _SharedBf16Cast.apply(x, xb)
        return out
    return xb


def _bf16_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The bf16 rule for one ``nn.Linear`` (bound to the module while the context is open)."""
    y = nn.functional.linear(shared_bf16_input(x), bf16_weight(self)).float()
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
def matmul_precision(model: Any, precision: str, share_input_casts: bool = True
                     ) -> Iterator[None]:
    """Run every ``nn.Linear`` of ``model`` under ``precision`` inside the block.

    ``float32`` changes nothing. ``bfloat16`` binds the module doc's rule to each Linear for
    the duration of the block (autograd graphs built inside keep it for their backward) and
    restores the plain forward on exit, even on error. ``share_input_casts`` (bf16): Linears
    reading the same input share one bf16 copy of it (the module doc; bit-identical, fewer
    copies); False casts per Linear (the reference the tests and benchmarks compare with).
    The outermost block decides, and its exit forgets the kept copy.
    """
    check_precision(precision)
    if precision == "float32":
        yield
        return
    linears = [] if model.__dict__.get("_closedloop_bound_rule") == precision else _bind_rule(
        model)
    outer = _SLOT.depth == 0
    if outer:
        _SLOT.share, _SLOT.entries = share_input_casts, ()
    _SLOT.depth += 1
    try:
        yield
    finally:
        _SLOT.depth -= 1
        if outer:
            _SLOT.share, _SLOT.entries = False, ()
        for m in linears:
            del m.forward


def bind_matmul_precision(model: Any, precision: str) -> None:
    """Bind ``precision``'s rule to ``model``'s Linears for good (once): for a copy held for
    scoring only, whose ``matmul_precision`` blocks then skip the walk over its modules and
    the binding (input casts are still shared inside a block). ``float32`` binds nothing."""
    check_precision(precision)
    if precision == "float32" or model.__dict__.get("_closedloop_bound_rule") == precision:
        return
    _bind_rule(model)
    model.__dict__["_closedloop_bound_rule"] = precision


def _bind_rule(model: Any) -> list[nn.Linear]:
    """Bind the bf16 rule to each ``nn.Linear`` of ``model`` running its own forward; those
    Linears."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)
               and "forward" not in m.__dict__]
    for m in linears:
        m.forward = types.MethodType(_bf16_linear_forward, m)  # type: ignore[method-assign]
    return linears


def drop_bf16_copies(model: Any) -> None:
    """Forget the cached bf16 copies of frozen weights (they are rebuilt on next use)."""
    for m in model.modules():
        m.__dict__.pop("_closedloop_bf16", None)
