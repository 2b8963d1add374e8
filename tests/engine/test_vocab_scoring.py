"""Target log-probs through the vocabulary head (``closedloop.engine.vocab_scoring``): values and
gradients equal autograd over ``logits[x] - logsumexp(logits)`` for plain and bf16 heads, with
and without bias and a trainable head, across vocabulary slices and row chunks; no-grad calls
equal the grad calls; a head that is not a plain Linear takes the generic path."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from closedloop.engine import reference_logprobs, sequence_logprobs
from closedloop.engine.precision import linear_precision, matmul_precision
from closedloop.engine.vocab_scoring import target_logprobs
from closedloop.policy import attach_lora, build_tiny_model


def _reference(head: nn.Module, h: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    z = head(h).float()
    return z.gather(-1, tgt[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)


def _grads(fn, head: nn.Linear, h: torch.Tensor, tgt: torch.Tensor, g: torch.Tensor):
    """(values, grads of h / weight / bias that require grad) of ``sum(g * fn(head, h, tgt))``."""
    leaves = [t for t in (h, head.weight, head.bias) if t is not None and t.requires_grad]
    lp = fn(head, h, tgt)
    grads = torch.autograd.grad((lp * g).sum(), leaves)
    return lp.detach(), grads


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("train_head", [False, True])
def test_values_and_gradients_equal_the_autograd_chain(precision, bias, train_head):
    torch.manual_seed(0)
    head = nn.Linear(24, 5003, bias=bias)  # a vocabulary that no slice width divides
    head.weight.requires_grad_(train_head)
    h = torch.randn(37, 24, requires_grad=True)
    tgt = torch.randint(0, 5003, (37,))
    tgt[:3] = torch.tensor([0, 5002, 4096])  # first, last, and a slice boundary
    g = torch.randn(37)

    def ours(m, x, t):  # 3 row chunks, 2 vocabulary slices per chunk
        return target_logprobs(m, x, t, chunk_size=16, slice_bytes=4096 * 16 * 4)

    with matmul_precision(head, precision):
        assert linear_precision(head) == precision
        lp, grads = _grads(ours, head, h, tgt, g)
        ref_lp, ref_grads = _grads(_reference, head, h, tgt, g)
        with torch.no_grad():
            nograd_lp = ours(head, h, tgt)
    # the forward rounds exactly as the module does; bf16 gradients round their GEMM output
    # to bf16 per slice instead of once (2^-8 relative)
    assert torch.allclose(lp, ref_lp, atol=5e-6)
    assert torch.equal(nograd_lp, lp) or torch.allclose(nograd_lp, lp, atol=5e-6)
    tol = 1e-5 if precision == "float32" else 2e-2
    for ours_g, ref_g in zip(grads, ref_grads, strict=True):
        assert (ours_g - ref_g).abs().max() <= tol * ref_g.abs().max()


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), vocab=st.integers(2, 300), chunk=st.integers(1, 50),
       slice_cols=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_any_shape_of_rows_chunks_and_slices_gives_the_log_softmax(n, vocab, chunk, slice_cols,
                                                                  seed):
    torch.manual_seed(seed)
    head = nn.Linear(8, vocab, bias=seed % 2 == 0)
    h = torch.randn(n, 8) * 3
    tgt = torch.randint(0, vocab, (n,))
    # slice_bytes as small as it goes: the width floors at 1,024 columns
    lp = target_logprobs(head, h, tgt, chunk_size=chunk, slice_bytes=slice_cols)
    expect = torch.log_softmax(head(h), dim=-1).gather(-1, tgt[:, None]).squeeze(-1)
    assert torch.allclose(lp, expect, atol=1e-5)
    assert bool((lp <= 0).all())


def test_a_head_that_is_not_a_plain_linear_takes_the_generic_path():
    torch.manual_seed(0)
    inner = nn.Linear(16, 300)
    head = nn.Sequential(inner, nn.Tanh())  # any module mapping hidden to logits
    h = torch.randn(10, 16, requires_grad=True)
    tgt = torch.randint(0, 300, (10,))
    g = torch.randn(10)
    lp = target_logprobs(head, h, tgt, chunk_size=4)
    (dh,) = torch.autograd.grad((lp * g).sum(), [h])
    ref = _reference(head, h, tgt)
    (ref_dh,) = torch.autograd.grad((ref * g).sum(), [h])
    assert torch.allclose(lp, ref, atol=1e-6)
    assert torch.allclose(dh, ref_dh, atol=1e-6)


def test_a_patched_linear_is_not_taken_for_a_plain_one():
    head = nn.Linear(4, 9)
    assert linear_precision(head) == "float32"
    head.forward = lambda x: nn.functional.linear(x, head.weight) * 2  # type: ignore[method-assign]
    assert linear_precision(head) is None
    h, tgt = torch.randn(3, 4), torch.tensor([0, 4, 8])
    expect = torch.log_softmax(head(h), dim=-1).gather(-1, tgt[:, None]).squeeze(-1)
    assert torch.allclose(target_logprobs(head, h, tgt), expect, atol=1e-6)


@pytest.mark.parametrize("plain", [True, False])
def test_a_retained_graph_gives_the_same_gradient_twice(plain):
    torch.manual_seed(1)
    linear = nn.Linear(8, 3000, bias=True)
    head = linear if plain else nn.Sequential(linear)
    h = torch.randn(6, 8, requires_grad=True)
    lp = target_logprobs(head, h, torch.randint(0, 3000, (6,)), slice_bytes=1)
    first = torch.autograd.grad(lp.sum(), [h, linear.weight, linear.bias], retain_graph=True)
    second = torch.autograd.grad(lp.sum(), [h, linear.weight, linear.bias])
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b)


def test_a_head_in_another_dtype_scores_in_float32():
    torch.manual_seed(2)
    head = nn.Linear(8, 500).to(torch.bfloat16)  # a whole model cast to bf16
    h = torch.randn(5, 8, dtype=torch.bfloat16, requires_grad=True)
    tgt = torch.randint(0, 500, (5,))
    lp = target_logprobs(head, h, tgt)
    lp.sum().backward()
    assert lp.dtype == torch.float32 and h.grad is not None and h.grad.dtype == torch.bfloat16
    torch.testing.assert_close(lp.detach(), _reference(head, h, tgt).detach())


def test_under_autocast_the_head_computes_as_autocast_says():
    """The SFT warm start runs under ``torch.autocast``: the head's product follows it."""
    torch.manual_seed(4)
    head = nn.Linear(16, 3000)
    h = torch.randn(7, 16, requires_grad=True)
    tgt = torch.randint(0, 3000, (7,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp = target_logprobs(head, h, tgt)
        ref = _reference(head, h, tgt)
        (dh,) = torch.autograd.grad(lp.sum(), [h])
        (ref_dh,) = torch.autograd.grad(ref.sum(), [h])
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, ref)
    torch.testing.assert_close(dh, ref_dh)
    fp32 = target_logprobs(head, h, tgt)
    assert float((fp32 - lp).detach().abs().max()) > 1e-4  # autocast did apply


def test_no_targets_give_an_empty_result():
    out = target_logprobs(nn.Linear(4, 9), torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))
    assert out.shape == (0,) and out.dtype == torch.float32


def test_policy_log_probs_and_lora_gradients_equal_the_reference_path(tokenizer):
    """End to end on a tiny Llama with LoRA: the trainer path's head scoring equals the plain
    transformers path (``reference_logprobs``: full logits, log-softmax, gather) in values and
    LoRA gradients."""
    model = attach_lora(build_tiny_model(tokenizer, seed=3), r=4, alpha=8)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            nn.init.normal_(p, std=0.05)
    ids = torch.randint(0, 200, (3, 12), generator=torch.Generator().manual_seed(0))
    assert model.get_base_model().get_output_embeddings().weight.requires_grad is False

    def scored(fn):
        model.zero_grad(set_to_none=True)
        lp = fn(model, ids)
        lp.sum().backward()
        return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                             if p.grad is not None}

    ours_lp, ours_g = scored(sequence_logprobs)
    ref_lp, ref_g = scored(reference_logprobs)
    assert torch.allclose(ours_lp, ref_lp, atol=1e-5)
    assert ours_g.keys() == ref_g.keys() and ours_g
    for name, grad in ours_g.items():
        assert torch.allclose(grad, ref_g[name], atol=1e-6, rtol=1e-4), name


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("generic", [False, True])
def test_target_logprobs_score_the_tempered_softmax_with_its_gradient(bias, generic):
    torch.manual_seed(0)
    head = nn.Linear(16, 300, bias=bias)
    h = torch.randn(7, 16, requires_grad=True)
    tgt = torch.randint(0, 300, (7,))
    scored_head = nn.Sequential(head) if generic else head  # Sequential: the generic path
    got = target_logprobs(scored_head, h, tgt, temperature=0.7)
    want = torch.log_softmax(head(h) / 0.7, dim=-1).gather(1, tgt[:, None])[:, 0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    (g_got,) = torch.autograd.grad(got.sum(), h)
    (g_want,) = torch.autograd.grad(want.sum(), h)
    torch.testing.assert_close(g_got, g_want, rtol=0, atol=1e-5)
    untempered = target_logprobs(scored_head, h, tgt)
    assert float((untempered - got).detach().abs().max()) > 1e-2  # τ changes what is scored
