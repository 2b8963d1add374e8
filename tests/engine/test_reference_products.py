"""The probe reference's float32 products (packed frozen weights, ``(W xᵀ)ᵀ`` for a few
rows): the same values as ``nn.Linear`` up to float32 summation order, only where promised (no
gradients, float32 Linears running their own forward; packed only when asked, frozen and wide
enough), and the probe reference unchanged by them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from closedloop.engine import trainer_probe_reference
from closedloop.engine.llama_decode import onednn_fp32_packing
from closedloop.engine.precision import linear_precision, matmul_precision
from closedloop.engine.reference_products import FEW_ROWS, reference_products
from closedloop.policy import attach_lora
from closedloop.policy.tiny_model import build_tiny_model

# float32 products over K=64 terms of O(1) values: summation-order differences stay within a
# few ulps of the sums' magnitude (|y| ~ 8: 2^-20 relative ~ 1e-5 absolute)
ATOL = 1e-4


def test_products_equal_linears_and_leave_the_module_as_it_was() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 80, bias=False))
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        expected = model(x)
        with reference_products(model):
            assert all("forward" in m.__dict__ for m in model)
            got = model(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert all("forward" not in m.__dict__ for m in model)


def test_many_rows_and_gradients_keep_the_linear_product() -> None:
    torch.manual_seed(1)
    lin = nn.Linear(16, 8)
    many = torch.randn(FEW_ROWS + 1, 16)
    few = torch.randn(4, 16, requires_grad=True)
    with reference_products(lin):
        with torch.no_grad():
            assert torch.equal(lin(many), nn.functional.linear(many, lin.weight, lin.bias))
        out = lin(few)  # gradients on: nn.Linear's own product, differentiable
        assert torch.equal(out, nn.functional.linear(few, lin.weight, lin.bias))
        out.sum().backward()
    assert few.grad is not None


def test_linears_under_the_bf16_rule_are_left_to_it() -> None:
    lin = nn.Linear(16, 8)
    with matmul_precision(lin, "bfloat16"), reference_products(lin):
        assert linear_precision(lin) == "bfloat16"
    assert linear_precision(lin) == "float32"


def test_the_probe_reference_matches_the_plain_forward(tokenizer) -> None:
    model = attach_lora(build_tiny_model(tokenizer, seed=0), seed=1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    model.eval()
    ids = tokenizer.encode("Probe: repair config.json.")
    got = trainer_probe_reference(model, 0.7, "float32")(ids[:1], ids[1:])
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float() / 0.7
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])
    assert got == pytest.approx(expected.squeeze(-1).tolist(), abs=ATOL)
    assert all("forward" not in m.__dict__ for m in model.modules() if isinstance(m, nn.Linear))


@pytest.mark.skipif(not onednn_fp32_packing(), reason="torch without oneDNN")
def test_wide_frozen_weights_are_packed_once_per_version() -> None:
    torch.manual_seed(2)
    wide = nn.Linear(256, 320).requires_grad_(False)
    trained = nn.Linear(256, 320)  # requires grad: never packed
    x = torch.randn(7, 256)
    with torch.no_grad():
        expected, expected_t = wide(x), trained(x)
        with reference_products(wide, packed=True), reference_products(trained, packed=True):
            torch.testing.assert_close(wide(x), expected, atol=ATOL, rtol=0)
            torch.testing.assert_close(trained(x), expected_t, atol=ATOL, rtol=0)
            first = wide.__dict__["_closedloop_packed"][1]
            wide(x)
            assert wide.__dict__["_closedloop_packed"][1] is first  # kept, not re-packed
            wide.weight.add_(1.0)  # a new version of the weight is packed anew
            torch.testing.assert_close(wide(x), nn.functional.linear(x, wide.weight, wide.bias),
                                       atol=ATOL, rtol=0)
            assert wide.__dict__["_closedloop_packed"][1] is not first
        assert "_closedloop_packed" not in trained.__dict__
        with reference_products(wide):  # packed=False: the few-row form
            torch.testing.assert_close(wide(x), nn.functional.linear(x, wide.weight, wide.bias),
                                       atol=ATOL, rtol=0)


def test_a_scoring_copy_is_bound_once_and_scores_as_before(tokenizer) -> None:
    from closedloop.engine.reference_products import bind_reference_products

    model = attach_lora(build_tiny_model(tokenizer, seed=0), seed=1).eval()
    ids = tokenizer.encode("Probe: repair config.json.")
    before = trainer_probe_reference(model, 0.7, "float32")(ids[:1], ids[1:])
    score = trainer_probe_reference(model, 0.7, "float32", packed=True)
    bound = {id(m): m.__dict__["forward"] for m in model.modules() if isinstance(m, nn.Linear)}
    bind_reference_products(model)  # a second binding changes nothing
    assert all(m.__dict__["forward"] is bound[id(m)]
               for m in model.modules() if isinstance(m, nn.Linear))
    assert score(ids[:1], ids[1:]) == pytest.approx(before, abs=ATOL)


def test_a_scoring_copy_bound_to_the_bf16_rule_scores_bit_for_bit_as_the_block(
        tokenizer) -> None:
    from closedloop.engine.precision import bind_matmul_precision

    model = attach_lora(build_tiny_model(tokenizer, seed=0), seed=1).eval()
    ids = tokenizer.encode("Probe: repair config.json.")
    before = trainer_probe_reference(model, 0.7, "bfloat16")(ids[:1], ids[1:])
    assert all(linear_precision(m) == "float32" for m in model.modules()
               if isinstance(m, nn.Linear))  # the block left nothing bound
    score = trainer_probe_reference(model, 0.7, "bfloat16", packed=True)
    assert all(linear_precision(m) == "bfloat16" for m in model.modules()
               if isinstance(m, nn.Linear))
    bind_matmul_precision(model, "bfloat16")  # once only
    assert score(ids[:1], ids[1:]) == before
