"""Decode attention as two C loops (attention_loops): the matmul form's result, the cache read
in place."""

import math

import pytest
import torch

from closedloop.engine import attention_loops as da
from closedloop.engine import native_build
from closedloop.engine.llama_decode import LlamaDecodeCopy
from tests.engine.test_llama_decode import _lora, _run

pytestmark = pytest.mark.skipif(not da.available(),
                                reason=f"no native build here: {native_build.why_not(da.NAME)}")


def _matmul_form(q, keys, values, allowed, scale):
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    return torch.matmul(torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1), values)


def _case(seed, b, h, g, length, d, capacity, pad):
    """Random q and a cache held as the first ``length`` columns of a ``capacity`` buffer (the
    generator's layout: strided in b and h), rows left-padded by ``pad[b]`` masked columns."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, g, d, generator=gen)
    kbuf = torch.randn(b, h, capacity, d, generator=gen)
    vbuf = torch.randn(b, h, capacity, d, generator=gen)
    allowed = torch.ones(b, 1, 1, length, dtype=torch.bool)
    for row, n in enumerate(pad):
        allowed[row, ..., :n] = False
    return q, kbuf[:, :, :length], vbuf[:, :, :length], allowed


def _bound(q, keys, values, scale, d):
    """An error bound from the arithmetic: each score is a d-term float32 dot product, so
    |Δs| <= d·ε·max|q|·max|k|·scale; the softmax weights then move by at most ~2|Δs| relative,
    and the output (a convex combination of L values, summed in float32) by at most
    (2|Δs| + L·ε)·max|v|; with a 4x margin."""
    eps = torch.finfo(torch.float32).eps
    ds = d * eps * float(q.abs().max() * keys.abs().max()) * scale
    return 4 * (2 * ds + eps * keys.shape[2]) * float(values.abs().max())


@pytest.mark.parametrize("b,h,g,length,d,capacity,pad", [
    (2, 3, 3, 620, 64, 700, [0, 37]),     # SmolLM2's heads, a padded row, threaded
    (5, 2, 1, 9, 16, 9, [0, 2, 8, 0, 3]),  # multi-head attention, the generic width, one thread
    (1, 1, 4, 1, 8, 4, [0]),               # one key
])
def test_equals_the_matmul_form(b, h, g, length, d, capacity, pad):
    q, keys, values, allowed = _case(0, b, h, g, length, d, capacity, pad)
    scale = 1 / math.sqrt(d)
    got = da.decode_attention(q, keys, values, allowed, scale)
    want = _matmul_form(q, keys, values, allowed, scale)
    assert got is not None and got.shape == want.shape
    assert float((got - want).abs().max()) <= _bound(q, keys, values, scale, d)


def test_masked_keys_take_no_weight():
    """A masked key's value never reaches the output, however large."""
    q, keys, values, allowed = _case(1, 2, 3, 3, 50, 64, 50, [10, 0])
    values = values.clone()
    values[0, :, :10] = 1e30
    out = da.decode_attention(q, keys, values, allowed, 0.125)
    assert out is not None and bool(torch.isfinite(out).all())


def test_it_declines_what_it_cannot_run(monkeypatch):
    q, keys, values, allowed = _case(2, 1, 3, 3, 20, 64, 20, [0])
    assert da.decode_attention(q.bfloat16(), keys.bfloat16(), values.bfloat16(), allowed,
                               0.1) is None
    grad_q = q.clone().requires_grad_()
    assert da.decode_attention(grad_q, keys, values, allowed, 0.1) is None
    with torch.no_grad():
        assert da.decode_attention(grad_q, keys, values, allowed, 0.1) is not None
    assert da.decode_attention(q, keys.transpose(-1, -2).contiguous().transpose(-1, -2),
                               values, allowed, 0.1) is None  # last dimension strided
    monkeypatch.setenv(native_build.DISABLE_ENV, "0")
    assert da.decode_attention(q, keys, values, allowed, 0.1) is None


def test_the_decode_copy_decodes_alike_with_and_without_the_loops(tokenizer, monkeypatch):
    """The generator's decode steps give the same logits on both paths (float32 rounding)."""
    model = _lora(tokenizer)
    copy = LlamaDecodeCopy(model)
    rows = [[5, 17, 300, 41, 9, 77, 12], [88, 3], [1000, 2000, 30, 4]]
    steps = [[7, 8, 9], [11, 12, 13], [400, 500, 600]]
    calls = []
    real = da.decode_attention
    monkeypatch.setattr("closedloop.engine.llama_decode.decode_attention",
                        lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        fused = _run(copy, rows, steps)
    assert len(calls) == len(steps) * len(copy.layers)
    monkeypatch.setenv(native_build.DISABLE_ENV, "0")
    with torch.no_grad():
        plain = _run(copy, rows, steps)
    for a, b in zip(fused, plain, strict=True):
        assert float((a - b).abs().max()) < 1e-4
