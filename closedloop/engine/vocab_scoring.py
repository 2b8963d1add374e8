"""Log-probs of target tokens through the vocabulary head, without a ``[N, V]`` autograd chain.

For hidden states ``h_N_H``, head weight ``W_V_H`` (bias ``b_V``) and targets ``x_N``:

    z = h W^T + b,    lp[n] = z[n, x_n] - logsumexp_v z[n, v]

and its gradient, for an upstream gradient ``g_N``:

    dz[n, v] = g_n * (1[v = x_n] - softmax(z[n])_v),   dh = dz W,   dW = dz^T h,   db = Σ_n dz.

Autograd over ``gather`` and ``logsumexp`` builds that gradient from a zero-filled ``[N, V]``
tensor, a scatter, and three more ``[N, V]`` temporaries; on SmolLM2 (V = 49,152) each is
~180 MB at N = 900 targets. Above glibc's 32 MiB mmap limit every such temporary is freshly
mapped and page-faulted, and the faults and extra passes cost more than the head GEMMs
themselves. ``target_logprobs`` instead projects the vocabulary in column slices small enough
to stay in the heap (``slice_bytes``), keeps the slices' logits for the backward, and turns them
into ``dz`` in place (``sub_``, ``exp_``, ``mul_``, one scatter): no ``[N, V]`` allocation, no
zero fill. No-grad calls (the reference pass) keep nothing and reduce each slice in place. A
second backward through the same graph (``retain_graph=True``) recomputes the slices.

The matmul precision of the head is kept (``closedloop.engine.precision``): under ``bfloat16``
both products round their operands to bf16 and accumulate in fp32, as ``nn.Linear`` under
``matmul_precision`` does, forward and backward. Heads that are not a plain float32
``nn.Linear`` (a LoRA-wrapped head, a patched forward, a model cast to bf16, a forward under
``torch.autocast``) go through ``head(h)`` in row chunks, with a backward that makes one softmax
and updates it in place (``_TargetLogSoftmax``). Values equal the autograd chain's up to fp32
summation order (the logsumexp is combined across slices).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from closedloop.engine.precision import bf16_matmul, bf16_weight, linear_precision

SLICE_BYTES = 24 * 2**20  # under glibc's 32 MiB mmap threshold: slices are recycled in the heap


def target_logprobs(head: Any, hidden_N_H: torch.Tensor, tgt_N: torch.Tensor,
                    chunk_size: int = 1024, slice_bytes: int = SLICE_BYTES,
                    temperature: float = 1.0) -> torch.Tensor:
    """Return float32 ``log softmax(head(h) / τ)[n, x_n]`` ``[N]`` (module doc); gradients flow
    to ``hidden`` and to the head's parameters that require them.

    ``temperature`` τ is the sampler's: the distribution that sampled the tokens is
    ``softmax(z / τ)``, so that is what the trainer, the reference and the auditor score. For a
    linear head ``z / τ = (h / τ) W^T + b / τ``, so the sliced path scales its inputs.
    """
    if hidden_N_H.shape[0] == 0:
        return hidden_N_H.new_zeros(0, dtype=torch.float32)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    plain = (type(head) is nn.Linear and head.weight.dtype == torch.float32 == hidden_N_H.dtype
             and not torch.is_autocast_enabled(hidden_N_H.device.type))
    precision = linear_precision(head) if plain else None
    parts = []
    for lo in range(0, hidden_N_H.shape[0], chunk_size):
        h_n_H, tgt_n = hidden_N_H[lo:lo + chunk_size], tgt_N[lo:lo + chunk_size]
        if precision is None:
            z_n_V = head(h_n_H).float()
            parts.append(_TargetLogSoftmax.apply(z_n_V if temperature == 1.0
                                                 else z_n_V / temperature, tgt_n))
        else:
            bias = head.bias
            if temperature != 1.0:
                h_n_H = h_n_H / temperature
                bias = None if bias is None else bias / temperature
            width = max(1024, slice_bytes // (4 * h_n_H.shape[0]) // 1024 * 1024)
            w_q = bf16_weight(head).detach() if precision == "bfloat16" else None
            keep = torch.is_grad_enabled() and (
                h_n_H.requires_grad or head.weight.requires_grad
                or (head.bias is not None and head.bias.requires_grad))
            parts.append(_SlicedHeadLogprob.apply(h_n_H, head.weight, bias, tgt_n, w_q,
                                                  width, keep))
    return torch.cat(parts)


def _matmul(a: torch.Tensor, b: torch.Tensor, bf16: bool) -> torch.Tensor:
    """``a @ b`` in fp32, or ``float32(bf16(a) @ bf16(b))`` under the bf16 rule (``b`` may
    already be bf16)."""
    return bf16_matmul(a, b.to(torch.bfloat16)) if bf16 else torch.matmul(a, b)


def _exp_shifted(d: torch.Tensor) -> torch.Tensor:
    """``exp(d)`` in place for ``d <= 0``, with ``d`` floored at -87: ``exp(-87)`` is the
    smallest normal float32, so no result is subnormal (an exp over a [896, 6144] slice whose
    results were partly subnormal took 59 ms here instead of 8 ms), and a term under 1.7e-38
    beside the row maximum's 1 changes no float32 sum or softmax."""
    return d.clamp_(min=-87.0).exp_()


def _targets_in(tgt_N: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, columns within the slice) of the targets in vocabulary slice ``[lo, hi)``."""
    rows = torch.nonzero((tgt_N >= lo) & (tgt_N < hi)).squeeze(1)
    return rows, tgt_N[rows] - lo


class _SlicedHeadLogprob(torch.autograd.Function):
    """``lp = (hW^T + b)[x] - logsumexp(hW^T + b)`` over vocabulary slices of ``width``.

    ``w_q`` is the head's bf16 weight under the bf16 rule (``None``: fp32); ``keep`` says a
    backward will follow, so the slices' logits are kept for it.
    """

    @staticmethod
    def forward(ctx: Any, h_N_H: torch.Tensor, w_V_H: torch.Tensor, b_V: torch.Tensor | None,
                tgt_N: torch.Tensor, w_q: torch.Tensor | None, width: int,
                keep: bool) -> torch.Tensor:
        bf16 = w_q is not None
        w_mm = w_q if w_q is not None else w_V_H
        vocab = w_V_H.shape[0]
        picked_N = torch.zeros(h_N_H.shape[0], dtype=torch.float32, device=h_N_H.device)
        lse_parts, slices = [], []
        for lo in range(0, vocab, width):
            z_N_v = _matmul(h_N_H, w_mm[lo:lo + width].t(), bf16)
            if b_V is not None:
                z_N_v += b_V[lo:lo + width]
            at = _targets_in(tgt_N, lo, lo + z_N_v.shape[1])
            picked_N[at[0]] = z_N_v[at]
            m_N = z_N_v.amax(dim=1, keepdim=True)
            # keep the slice for the backward, or reduce it in place: nothing else needs it
            shifted = z_N_v - m_N if keep else z_N_v.sub_(m_N)
            lse_parts.append(_exp_shifted(shifted).sum(dim=1).log_() + m_N.squeeze(1))
            if keep:
                slices.append(z_N_v)
        lse_N = torch.logsumexp(torch.stack(lse_parts, dim=1), dim=1)
        if keep:
            ctx.save_for_backward(h_N_H, w_mm, b_V, tgt_N, lse_N)
            ctx.slices, ctx.bf16, ctx.width = slices, bf16, width
        return picked_N - lse_N

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g_N: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        h_N_H, w_mm, b_V, tgt_N, lse_N = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dh_N_H = torch.zeros_like(h_N_H) if need_h else None
        dw_V_H = w_mm.new_zeros(w_mm.shape, dtype=torch.float32) if need_w else None
        db_V = w_mm.new_zeros(w_mm.shape[0], dtype=torch.float32) if need_b else None
        g_col = g_N[:, None].float()
        # the first backward consumes the kept logits; a second one (retain_graph) recomputes
        slices, ctx.slices = ctx.slices, [None] * len(ctx.slices)
        for k, kept in enumerate(slices):
            lo = k * ctx.width
            hi = min(lo + ctx.width, w_mm.shape[0])
            dz_N_v = kept if kept is not None else _matmul(h_N_H, w_mm[lo:hi].t(), ctx.bf16)
            if kept is None and b_V is not None:
                dz_N_v += b_V[lo:hi]
            slices[k] = None  # free each slice as soon as it is used
            # softmax in place, then dz = g * (onehot - softmax)
            _exp_shifted(dz_N_v.sub_(lse_N[:, None])).mul_(-g_col)
            at = _targets_in(tgt_N, lo, hi)
            dz_N_v[at] += g_N[at[0]].float()
            if dh_N_H is not None:
                dh_N_H += _matmul(dz_N_v, w_mm[lo:hi], ctx.bf16)
            if dw_V_H is not None:
                dw_V_H[lo:hi] = _matmul(dz_N_v.t(), h_N_H, ctx.bf16)
            if db_V is not None:
                db_V[lo:hi] = dz_N_v.sum(dim=0)
        return dh_N_H, dw_V_H, db_V, None, None, None, None


class _TargetLogSoftmax(torch.autograd.Function):
    """``log_softmax(z)[x]`` for logits ``z`` computed by any head; the backward builds
    ``g * (onehot - softmax(z))`` with one softmax and in-place updates."""

    @staticmethod
    def forward(ctx: Any, z_N_V: torch.Tensor, tgt_N: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(z_N_V, tgt_N)
        return torch.log_softmax(z_N_V, dim=-1).gather(-1, tgt_N[:, None]).squeeze(-1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g_N: torch.Tensor) -> tuple[torch.Tensor, None]:
        z_N_V, tgt_N = ctx.saved_tensors
        dz_N_V = torch.softmax(z_N_V, dim=-1).mul_(-g_N[:, None])
        dz_N_V.scatter_add_(-1, tgt_N[:, None], g_N[:, None])
        return dz_N_V, None
