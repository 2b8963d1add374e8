"""Weight identity: checksum sensitivity, LoRA base/adapter/combined, adapter round trip."""

import warnings

import pytest
import torch

from closedloop.contracts import SamplerConfig
from closedloop.engine import HFGenerator, sequence_logprobs
from closedloop.policy import (
    AdapterError,
    attach_lora,
    build_tiny_model,
    load_adapter,
    policy_weight_checksum,
    save_adapter,
    split_state_dict,
    weights_checksum,
)
from closedloop.policy.weights import checksum_tensors, state_dict_checksum


def test_checksum_is_deterministic_and_sees_one_changed_weight(tokenizer):
    a, b = build_tiny_model(tokenizer, seed=0), build_tiny_model(tokenizer, seed=0)
    assert weights_checksum(a) == weights_checksum(b)
    assert weights_checksum(build_tiny_model(tokenizer, seed=1)) != weights_checksum(a)
    with torch.no_grad():
        w = b.model.layers[1].mlp.down_proj.weight
        w[3, 5] = torch.nextafter(w[3, 5], torch.tensor(1.0))  # one ulp of one weight
    assert weights_checksum(b) != weights_checksum(a)
    assert weights_checksum(a.to(torch.bfloat16)) != weights_checksum(b)


def test_checksum_covers_names_and_shapes():
    t = torch.arange(6, dtype=torch.float32)
    base = checksum_tensors([("w", t)])
    assert checksum_tensors([("v", t)]) != base
    assert checksum_tensors([("w", t.reshape(2, 3))]) != base
    assert checksum_tensors([("w", t.reshape(2, 3).t())]) != checksum_tensors(
        [("w", t.reshape(2, 3))])


def test_lora_changes_the_combined_checksum_not_the_base(tokenizer, tmp_path):
    model = build_tiny_model(tokenizer, seed=0)
    plain = weights_checksum(model)
    peft_model = attach_lora(model, r=4, alpha=8, seed=3)
    ck = policy_weight_checksum(peft_model)
    assert ck.base_checksum == plain and ck.adapter_checksum is not None
    assert ck.combined not in (plain, ck.adapter_checksum)
    base_sd, adapter_sd = split_state_dict(peft_model)
    assert state_dict_checksum(adapter_sd) == ck.adapter_checksum
    assert state_dict_checksum(base_sd) == plain and all("lora_" in n for n in adapter_sd)
    again = policy_weight_checksum(attach_lora(build_tiny_model(tokenizer, seed=0), r=4,
                                               alpha=8, seed=3))
    assert again == ck  # seeded adapter initialization
    with torch.no_grad():
        next(p for n, p in peft_model.named_parameters() if "lora_B" in n)[0, 0] += 1e-3
    moved = policy_weight_checksum(peft_model)
    assert moved.base_checksum == plain and moved.combined != ck.combined
    path = save_adapter(peft_model, tmp_path / "adapter")
    reloaded = load_adapter(build_tiny_model(tokenizer, seed=0), path)
    assert policy_weight_checksum(reloaded) == moved
    with pytest.raises(AdapterError):
        save_adapter(peft_model, path)
    with pytest.raises(AdapterError):
        load_adapter(build_tiny_model(tokenizer), tmp_path)


def test_lora_model_generates_and_scores_consistently(tokenizer, renderer):
    model = attach_lora(build_tiny_model(tokenizer, seed=0), seed=1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    gen = HFGenerator(model, tokenizer)
    assert gen.weight_checksum == policy_weight_checksum(model).combined
    prompt = renderer.render_prompt("Repair a.json")
    g = gen.generate(prompt, SamplerConfig(temperature=1.0), renderer.stop_sequences, 6, seed=0)
    ids = torch.tensor([prompt + g.action_token_ids])
    with torch.no_grad():
        lp = sequence_logprobs(model, ids)[0, len(prompt) - 1:]
    assert torch.allclose(lp, torch.tensor(g.raw_model_logprobs), atol=1e-4)
    loss = -sequence_logprobs(model, ids).sum()
    loss.backward()
    grads = [n for n, p in model.named_parameters() if p.grad is not None]
    assert grads and all("lora_" in n for n in grads)


def test_wrapping_and_loading_an_adapter_warn_nothing(tokenizer, tmp_path):
    """peft's read of a renamed transformers property is silenced; other warnings pass."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = attach_lora(build_tiny_model(tokenizer, seed=0), r=4, alpha=8)
        load_adapter(build_tiny_model(tokenizer, seed=0), save_adapter(model, tmp_path / "a"))
        warnings.warn("an unrelated deprecation", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["an unrelated deprecation"]


def _same_split(view_split, plain_split):
    for got, want in zip(view_split, plain_split, strict=True):
        assert list(got) == list(want)
        assert all(got[k].data_ptr() == want[k].data_ptr() and torch.equal(got[k], want[k])
                   for k in want)
        assert not any(t.requires_grad for t in got.values())


def test_split_view_is_split_state_dict_and_sees_replaced_and_updated_tensors(tokenizer):
    from closedloop.policy.lora import PolicyChecksummer, SplitView

    peft_model = attach_lora(build_tiny_model(tokenizer, seed=0), r=4, alpha=8, seed=3)
    view = SplitView(peft_model)
    _same_split(view(), split_state_dict(peft_model))
    name, lora_b = next((n, p) for n, p in peft_model.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        lora_b[0, 0] += 1.0  # in place
    _same_split(view(), split_state_dict(peft_model))
    owner = peft_model.get_submodule(name.rsplit(".", 1)[0])
    owner.weight = torch.nn.Parameter(torch.full_like(lora_b, 2.0))  # replaced
    _same_split(view(), split_state_dict(peft_model))
    assert torch.all(view()[1][name] == 2.0)
    checksummer = PolicyChecksummer(peft_model)
    assert checksummer() == policy_weight_checksum(peft_model)
    base_layer = peft_model.get_submodule("base_model.model.model.layers.0.mlp.down_proj")
    base_layer.weight = torch.nn.Parameter(base_layer.weight.detach() * 2, requires_grad=False)
    assert checksummer() == policy_weight_checksum(peft_model)  # a replaced base tensor too


def test_split_view_falls_back_where_a_hook_renames_entries(tokenizer):
    from closedloop.policy.lora import SplitView

    peft_model = attach_lora(build_tiny_model(tokenizer, seed=0), r=4, alpha=8, seed=3)

    def rename(module, state, prefix, local_metadata):
        key = next(k for k in state if k.endswith("norm.weight"))
        state["renamed." + key] = state.pop(key)

    peft_model.base_model.model.model._register_state_dict_hook(rename)
    _same_split(SplitView(peft_model)(), split_state_dict(peft_model))
