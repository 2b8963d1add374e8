"""The fused LoRA product: same function and gradients as peft's, peft's path where it must."""

import copy
import pickle

import pytest
import torch
from peft.tuners.lora.layer import Linear as LoraLinear

from closedloop.engine import matmul_precision
from closedloop.policy import attach_lora, build_tiny_model, load_adapter, save_adapter
from closedloop.policy.lora_product import FusedLoraLinear, fuse_lora_products

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _adapted(tokenizer, alpha=16, r=8, dropout=0.0, seed=0):
    model = attach_lora(build_tiny_model(tokenizer, seed=seed), r=r, alpha=alpha,
                        target_modules=TARGETS, dropout=dropout)
    with torch.no_grad():  # B = 0 at attach: give the adapter something to add
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def _lora_modules(model):
    return [m for m in model.modules() if isinstance(m, LoraLinear)]


def _as(model, cls):
    for m in _lora_modules(model):
        m.__class__ = cls


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    loss = torch.log_softmax(logits, -1)[..., 1:].square().mean()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return logits.detach(), grads


def _ids(n=2, t=24, seed=3):
    return torch.randint(0, 200, (n, t), generator=torch.Generator().manual_seed(seed))


def test_attach_and_load_switch_every_adapted_projection(tokenizer, tmp_path):
    model = attach_lora(build_tiny_model(tokenizer), target_modules=TARGETS)
    mods = _lora_modules(model)
    assert len(mods) == 2 * len(TARGETS)  # two layers
    assert all(type(m) is FusedLoraLinear for m in mods)
    save_adapter(model, tmp_path / "a")
    loaded = load_adapter(build_tiny_model(tokenizer), tmp_path / "a")
    assert all(type(m) is FusedLoraLinear for m in _lora_modules(loaded))
    assert fuse_lora_products(loaded) == 0  # already switched
    assert fuse_lora_products(build_tiny_model(tokenizer)) == 0


@pytest.mark.parametrize(("alpha", "r"), [(16, 8), (10, 4), (1, 3)])
def test_fused_forward_and_gradients_match_peft(tokenizer, alpha, r):
    """Same outputs and gradients as peft's forward, up to float32 summation order (``B``'s
    gradient is summed in another order, and the scale ``alpha / r`` is exact for 16/8 but
    rounds for 10/4 and 1/3). Both float32 paths sum the same terms, so both carry the same
    rounding bound (~n·eps32 times the sum of the terms' magnitudes, which for an entry whose
    terms cancel is far above the entry itself); the float64 gradients stand in for the exact
    ones, and the fused path may be at most 4x as far from them as peft's own float32 path is
    anywhere in that tensor (with a floor of 1e-5 of the tensor's largest entry)."""
    model = _adapted(tokenizer, alpha=alpha, r=r)
    ids = _ids()
    exact_model = copy.deepcopy(model).double()
    _as(exact_model, LoraLinear)
    _, exact_grads = _loss_and_grads(exact_model, ids)
    _as(model, LoraLinear)
    ref_logits, ref_grads = _loss_and_grads(model, ids)
    _as(model, FusedLoraLinear)
    logits, grads = _loss_and_grads(model, ids)
    assert len(grads) == len(ref_grads) == len(exact_grads) == 4 * len(TARGETS)  # A, B, 2 layers
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    for g, ref, exact in zip(grads, ref_grads, exact_grads, strict=True):
        peft_err = float((ref.double() - exact).abs().max())
        bound = max(4 * peft_err, 1e-5 * float(exact.abs().max()))
        assert float((g.double() - exact).abs().max()) <= bound


def test_dropout_draws_the_same_masks(tokenizer):
    model = _adapted(tokenizer, dropout=0.3)
    model.train()
    ids = _ids()
    _as(model, LoraLinear)
    torch.manual_seed(7)
    ref = model(input_ids=ids).logits.detach()
    _as(model, FusedLoraLinear)
    torch.manual_seed(7)
    torch.testing.assert_close(model(input_ids=ids).logits.detach(), ref, rtol=1e-5, atol=1e-5)


def test_unfusable_states_take_peft_path_exactly(tokenizer):
    """The bf16 rule bound to the Linears, adapters disabled, adapters merged: peft's own
    forward, so the outputs are bit-identical to it."""
    model = _adapted(tokenizer)
    model.eval()
    ids = _ids()

    def both(run):
        _as(model, LoraLinear)
        ref = run()
        _as(model, FusedLoraLinear)
        return ref, run()

    def bf16():
        with torch.no_grad(), matmul_precision(model, "bfloat16"):
            return model(input_ids=ids).logits

    def disabled():
        with torch.no_grad(), model.disable_adapter():
            return model(input_ids=ids).logits

    for run in (bf16, disabled):
        ref, out = both(run)
        assert torch.equal(out, ref)
    with torch.no_grad():
        unmerged = model(input_ids=ids).logits
        model.merge_adapter()
        merged = model(input_ids=ids).logits
        assert all(m.merged for m in _lora_modules(model))
        _as(model, LoraLinear)
        assert torch.equal(model(input_ids=ids).logits, merged)
    torch.testing.assert_close(merged, unmerged, rtol=1e-4, atol=1e-5)


def test_a_fused_model_deep_copies_and_pickles(tokenizer):
    model = _adapted(tokenizer)
    model.eval()
    ids = _ids()
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert all(type(m) is FusedLoraLinear for m in _lora_modules(clone))
            assert torch.equal(clone(input_ids=ids).logits, ref)
