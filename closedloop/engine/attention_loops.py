"""Decode attention (one new id per row) over a grouped-query K/V cache, streaming it once.

For each row ``b`` and key/value head ``h`` with its ``G`` query heads, over ``L`` cached ids:

    s[g, l] = scale * <q[b, h, g], K[b, h, l]>        (a masked l gets -inf)
    p[g]    = softmax(s[g])
    out[b, h, g] = sum_l p[g, l] * V[b, h, l]

The torch form is two batched matmuls, ``q [B, H, G, D] @ Kᵀ`` and ``p @ V``, with ``G`` rows
each (3 for SmolLM2). At decode sizes the cache dominates the bytes and each product's ``G``
rows leave the matmul kernel at one half to two thirds of the host's streaming rate (the "loops
built for the host" of ``docs/concepts.md``, measured in ``docs/performance.md``). Here each
product is a C loop (``native_build``), run on torch's OpenMP threads, that reads
every cached key and value exactly once and keeps the ``G`` query rows (or the ``G`` output rows)
in cache: the scores as ``G`` dot products per key, the output as ``G`` axpys per value, the
rows ``(b, h)`` split over ``torch.get_num_threads()`` threads. The mask and the softmax stay
torch's (the same calls as the matmul form), so only the two products' summation order differs
(float32 rounding: the dot products are vectorized).

``decode_attention`` returns ``None`` where the loops do not apply (not CPU float32, autograd
recording, a cache whose last dimension is strided, or no library: ``native_build.why_not``);
the caller then runs ``matmul_decode_attention``, the torch form.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from closedloop.engine.native_build import DISABLE_ENV, load_native, native_enabled, why_not

NAME = "attention_loops"
MIN_THREADED_FLOATS = 1 << 16
"""Below this many cached floats per call the loops run on one thread (an OpenMP region's fork
and join cost more than the work)."""

SOURCE = r"""
#include <stdint.h>
#include <string.h>

typedef struct {
    const float *x;      /* q [T, G, D] (scores) or p [T, G, L] (weighted sum), contiguous */
    const float *kv;     /* the cache: element (b, h, l, d) at b*sb + h*sh + l*sl + d */
    float *out;          /* scores [T, G, L] or out [T, G, D], contiguous */
    int64_t sb, sh, sl;
    int H, G, L, D;
    float scale;
    int start, stop;     /* rows t = b * H + h of this share */
} share_t;

static inline float dot(const float *a, const float *b, int n) {
    float acc = 0.0f;
    for (int i = 0; i < n; ++i) acc += a[i] * b[i];
    return acc;
}

static inline float dot64(const float *a, const float *b) {
    float acc = 0.0f;
    for (int i = 0; i < 64; ++i) acc += a[i] * b[i];
    return acc;
}

static void *scores_share(void *arg) {
    const share_t *s = (const share_t *)arg;
    const int G = s->G, L = s->L, D = s->D;
    for (int t = s->start; t < s->stop; ++t) {
        const float *q = s->x + (int64_t)t * G * D;
        const float *k = s->kv + (int64_t)(t / s->H) * s->sb + (int64_t)(t % s->H) * s->sh;
        float *o = s->out + (int64_t)t * G * L;
        for (int l = 0; l < L; ++l) {
            const float *kr = k + (int64_t)l * s->sl;
            for (int g = 0; g < G; ++g)
                o[(int64_t)g * L + l] = s->scale * (D == 64 ? dot64(q + g * 64, kr)
                                                            : dot(q + g * D, kr, D));
        }
    }
    return 0;
}

static void *wsum_share(void *arg) {
    const share_t *s = (const share_t *)arg;
    const int G = s->G, L = s->L, D = s->D;
    for (int t = s->start; t < s->stop; ++t) {
        const float *p = s->x + (int64_t)t * G * L;
        const float *v = s->kv + (int64_t)(t / s->H) * s->sb + (int64_t)(t % s->H) * s->sh;
        float *o = s->out + (int64_t)t * G * D;
        memset(o, 0, sizeof(float) * G * D);
        for (int l = 0; l < L; ++l) {
            const float *vr = v + (int64_t)l * s->sl;
            for (int g = 0; g < G; ++g) {
                const float w = p[(int64_t)g * L + l];
                if (w == 0.0f) continue;  /* a masked key: exp(-inf) */
                float *og = o + g * D;
                for (int d = 0; d < D; ++d) og[d] += w * vr[d];
            }
        }
    }
    return 0;
}

static int run(void *(*fn)(void *), share_t base, int rows, int threads) {
    enum { MAXT = 64 };
    share_t shares[MAXT];
    if (threads < 1) threads = 1;
    if (threads > MAXT) threads = MAXT;
    if (threads > rows) threads = rows > 0 ? rows : 1;
    for (int i = 0; i < threads; ++i) {
        shares[i] = base;
        shares[i].start = (int)((int64_t)rows * i / threads);
        shares[i].stop = (int)((int64_t)rows * (i + 1) / threads);
    }
    /* torch's own OpenMP runtime (libgomp.so.1 is already loaded), so its thread team runs
       these shares instead of competing with them for the cores */
    #pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int i = 0; i < threads; ++i) fn(&shares[i]);
    return 0;
}

int cl_decode_scores(const float *q, const float *k, int64_t sb, int64_t sh, int64_t sl,
                     float *out, int B, int H, int G, int L, int D, float scale, int threads) {
    share_t s = {q, k, out, sb, sh, sl, H, G, L, D, scale, 0, 0};
    return run(scores_share, s, B * H, threads);
}

int cl_decode_wsum(const float *p, const float *v, int64_t sb, int64_t sh, int64_t sl,
                   float *out, int B, int H, int G, int L, int D, int threads) {
    share_t s = {p, v, out, sb, sh, sl, H, G, L, D, 1.0f, 0, 0};
    return run(wsum_share, s, B * H, threads);
}
"""

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I = ctypes.c_int
_bound: dict[str, Any] = {}


def _library() -> Any | None:
    if not native_enabled():
        return None
    if "lib" in _bound:
        return _bound["lib"]
    lib = load_native(NAME, SOURCE)
    if lib is not None:
        lib.cl_decode_scores.argtypes = [_P, _P, _I64, _I64, _I64, _P, _I, _I, _I, _I, _I,
                                         ctypes.c_float, _I]
        lib.cl_decode_wsum.argtypes = [_P, _P, _I64, _I64, _I64, _P, _I, _I, _I, _I, _I, _I]
        lib.cl_decode_scores.restype = lib.cl_decode_wsum.restype = _I
    _bound["lib"] = lib
    return lib


def available() -> bool:
    """Whether the C loops are built and loaded on this host (``native_build.why_not``)."""
    return _library() is not None


def native_unavailable_reason() -> str | None:
    """Why the C loops do not run here (switched off, no compiler, a failed build), or
    ``None`` where they are built and loaded."""
    if not native_enabled():
        return f"{DISABLE_ENV}=0"
    return None if available() else why_not(NAME)


def _applies(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    tensors = (q, keys, values)
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    same = keys.shape == values.shape and q.dim() == keys.dim() == 4 \
        and q.shape[:2] == keys.shape[:2] and q.shape[3] == keys.shape[3]
    return same and keys.stride(-1) == 1 and values.stride(-1) == 1


def matmul_decode_attention(q_B_H_G_D: torch.Tensor, keys_B_H_L_D: torch.Tensor,
                            values_B_H_L_D: torch.Tensor, allowed_B_1_1_L: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """The module doc's formula as two batched matmuls, ``[B, H, G, D]``: the form every dtype,
    device and autograd state runs, and the one the loops are compared with."""
    scores = torch.matmul(q_B_H_G_D, keys_B_H_L_D.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed_B_1_1_L, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), values_B_H_L_D)


def decode_attention(q_B_H_G_D: torch.Tensor, keys_B_H_L_D: torch.Tensor,
                     values_B_H_L_D: torch.Tensor, allowed_B_1_1_L: torch.Tensor,
                     scale: float) -> torch.Tensor | None:
    """``out [B, H, G, D]`` of the module doc's formula, or ``None`` where the loops do not
    apply (the caller's matmul form then runs). ``allowed`` (bool, broadcastable to
    ``[B, H, G, L]``) is True for the keys a row may see; each row must see at least one."""
    if not _applies(q_B_H_G_D, keys_B_H_L_D, values_B_H_L_D):
        return None
    lib = _library()
    if lib is None:
        return None
    b, h, g, d = q_B_H_G_D.shape
    length = keys_B_H_L_D.shape[2]
    q = q_B_H_G_D.contiguous()
    threads = torch.get_num_threads() if b * h * length * d >= MIN_THREADED_FLOATS else 1
    scores = torch.empty(b, h, g, length, dtype=torch.float32)
    ks = keys_B_H_L_D.stride()
    lib.cl_decode_scores(q.data_ptr(), keys_B_H_L_D.data_ptr(), ks[0], ks[1], ks[2],
                         scores.data_ptr(), b, h, g, length, d, float(scale), threads)
    probs = torch.softmax(scores.masked_fill_(~allowed_B_1_1_L, float("-inf")), dim=-1)
    out = torch.empty(b, h, g, d, dtype=torch.float32)
    vs = values_B_H_L_D.stride()
    lib.cl_decode_wsum(probs.data_ptr(), values_B_H_L_D.data_ptr(), vs[0], vs[1], vs[2],
                       out.data_ptr(), b, h, g, length, d, threads)
    return out
