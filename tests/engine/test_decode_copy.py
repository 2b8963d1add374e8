"""The generator's decode copy: same logits as the policy, merged LoRA, published only on sync."""

import pytest
import torch

from closedloop.contracts import SamplerConfig
from closedloop.engine import HFGenerator
from closedloop.engine.decode_copy import DecodeCopy, TransposedLinear
from closedloop.policy import attach_lora, build_tiny_model

GREEDY = SamplerConfig(greedy=True)


def _lora_model(tokenizer, seed=0):
    model = attach_lora(build_tiny_model(tokenizer, seed=0), r=4, alpha=8, seed=1)
    _perturb_lora(model, seed)
    return model


def _perturb_lora(model, seed, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=g) * scale)


def _logits(forward, ids):
    with torch.no_grad():
        return forward(input_ids=ids).logits


def test_copy_equals_the_policy_and_merges_every_linear(tokenizer):
    model = _lora_model(tokenizer)
    copy = DecodeCopy(model)
    ids = torch.randint(0, 2000, (3, 19), generator=torch.Generator().manual_seed(0))
    with model.disable_adapter():
        base = _logits(model, ids)
    policy = _logits(model, ids)
    assert (policy - base).abs().max() > 1e-2  # the adapter matters
    assert (_logits(copy, ids) - policy).abs().max() < 1e-5
    layers = [m for m in copy.model.modules() if isinstance(m, TransposedLinear)]
    n_linear = sum(1 for m in build_tiny_model(tokenizer).modules()
                   if isinstance(m, torch.nn.Linear))
    assert len(layers) == n_linear  # LoRA wrappers and plain Linears alike, lm_head included
    assert not any("lora" in n for n, _ in copy.model.named_modules())


def test_copy_shares_no_storage_and_changes_only_on_sync(tokenizer):
    model = _lora_model(tokenizer)
    copy = DecodeCopy(model)
    ours = {t.data_ptr() for t in [*copy.model.parameters(), *copy.model.buffers()]}
    theirs = {t.data_ptr() for t in model.parameters()}
    assert not ours & theirs
    ids = torch.randint(0, 2000, (2, 11), generator=torch.Generator().manual_seed(1))
    before = _logits(copy, ids)
    _perturb_lora(model, seed=7, scale=0.2)
    with torch.no_grad():  # a non-LoRA tensor changes too (full fine-tuning)
        model.get_base_model().model.norm.weight.mul_(1.5)
    assert torch.equal(_logits(copy, ids), before)  # not published yet
    copy.sync()
    assert (_logits(copy, ids) - _logits(model, ids)).abs().max() < 1e-5


def test_generator_samples_published_weights_only(tokenizer, renderer):
    model = _lora_model(tokenizer)
    prompt = renderer.render_prompt("Repair a.json")
    fast = HFGenerator(model, tokenizer, seed=0)
    plain = HFGenerator(model, tokenizer, seed=0, decode_copy=False)
    a = fast.generate(prompt, SamplerConfig(), renderer.stop_sequences, 12, seed=3)
    b = plain.generate(prompt, SamplerConfig(), renderer.stop_sequences, 12, seed=3)
    assert a.action_token_ids == b.action_token_ids
    assert max(abs(x - y) for x, y in zip(a.raw_model_logprobs, b.raw_model_logprobs,
                                          strict=True)) < 1e-4
    _perturb_lora(model, seed=9, scale=0.5)
    stale = fast.generate(prompt, GREEDY, renderer.stop_sequences, 12, seed=0)
    new = plain.generate(prompt, GREEDY, renderer.stop_sequences, 12, seed=0)
    fast.refresh_weights()
    synced = fast.generate(prompt, GREEDY, renderer.stop_sequences, 12, seed=0)
    assert synced.action_token_ids == new.action_token_ids
    assert stale.raw_model_logprobs != pytest.approx(new.raw_model_logprobs, abs=1e-3)
