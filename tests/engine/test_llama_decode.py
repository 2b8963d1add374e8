"""The lean Llama decode copy: the policy's function in a flat layout, synced only where changed."""

import pytest
import torch

from closedloop.contracts import SamplerConfig
from closedloop.engine import HFGenerator, llama_decode
from closedloop.engine.decode_copy import DecodeCopy
from closedloop.engine.kv_cache import batch_cache
from closedloop.engine.llama_decode import LlamaDecodeCopy, onednn_bf16_packing, supports
from closedloop.policy import attach_lora, build_tiny_model
from tests.engine.test_decode_copy import _perturb_lora as _perturb


def _lora(tokenizer, seed=0, kv_heads=None):
    model = attach_lora(build_tiny_model(tokenizer, seed=0, init_std=0.3, kv_heads=kv_heads),
                        r=4, alpha=8, seed=1)
    _perturb(model, seed)
    return model


def _policy_last_logits(model, rows):
    """The policy module's next-token logits after each (unpadded) row."""
    with torch.no_grad():
        return torch.stack([model(input_ids=torch.tensor([r])).logits[0, -1] for r in rows])


def _run(copy, rows, steps):
    """Prefill ``rows`` (left-padded, empty cache), then feed ``steps`` columns of ids one at a
    time as the generator does; return the logits after the prefill and after each step."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    pos = torch.tensor([[0] * (width - len(r)) + list(range(len(r))) for r in rows])
    cache = batch_cache([None] * len(rows), 0, width + len(steps))
    out = [copy.last_logits(ids, mask, pos, cache)]
    last = pos[:, -1]
    for col in steps:
        mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=torch.long)], 1)
        last = last + 1
        out.append(copy.last_logits(torch.tensor(col)[:, None], mask, last[:, None], cache))
    return out


@pytest.mark.parametrize("packing", [False, True], ids=["strided", "packed"])
def test_tail_logits_are_the_policy_logits_at_every_kept_position(tokenizer, packing,
                                                                 monkeypatch):
    """``tail_logits(keep=k)`` is the policy's logits at the last k positions of each row
    (left padding invisible), and ``last_logits`` is its last column."""
    if packing:
        if not llama_decode.onednn_fp32_packing():
            pytest.skip("torch has no oneDNN here: float32 weights stay strided")
        monkeypatch.setattr(llama_decode, "FP32_PACK_MIN_WIDTH", 1)
    model = _lora(tokenizer)
    copy = LlamaDecodeCopy(model)
    rows = [[5, 17, 300, 41, 9, 77, 12], [88, 3, 1000, 2000, 30]]
    width, keep = 7, 4
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    pos = torch.tensor([[0] * (width - len(r)) + list(range(len(r))) for r in rows])
    with torch.no_grad():
        got = copy.tail_logits(ids, mask, pos, batch_cache([None, None], 0, width), keep)
        last = copy.last_logits(ids, mask, pos, batch_cache([None, None], 0, width))
        want = [model(input_ids=torch.tensor([r])).logits[0, -keep:] for r in rows]
    assert got.shape == (2, keep, want[0].shape[-1])
    for b in range(2):
        assert torch.allclose(got[b], want[b], atol=1e-4, rtol=0)
    assert torch.allclose(last, got[:, -1], atol=1e-5, rtol=0)  # other row counts, other sums


@pytest.mark.parametrize("kv_heads", [None, 4], ids=["gqa", "mha"])
def test_prefill_and_decode_equal_the_policy(tokenizer, kv_heads):
    model = _lora(tokenizer, kv_heads=kv_heads)
    copy = LlamaDecodeCopy(model)
    rows = [[5, 17, 300, 41, 9, 77, 12], [88, 3], [1000, 2000, 30, 4]]
    steps = [[7, 8, 9], [11, 12, 13], [400, 500, 600]]
    got = _run(copy, rows, steps)
    for k, logits in enumerate(got):
        want = _policy_last_logits(model, [r + [s[b] for s in steps[:k]]
                                           for b, r in enumerate(rows)])
        assert float((logits - want).abs().max()) < 1e-4, k
    with model.disable_adapter():  # the adapter is merged: the base alone differs
        base = _policy_last_logits(model, rows)
    assert float((got[0] - base).abs().max()) > 1e-2


def test_sync_rebuilds_only_what_changed(tokenizer):
    model = _lora(tokenizer)
    copy = LlamaDecodeCopy(model)
    rows = [[5, 17, 300, 41], [88, 3, 2, 1]]
    mlp, qkv = copy.layers[0].gate_up_t, copy.layers[0].qkv_t
    mlp_version, qkv_before = mlp._version, qkv.clone()
    before = _run(copy, rows, [])[0]
    _perturb(model, seed=7, scale=0.3)
    assert torch.equal(_run(copy, rows, [])[0], before)  # not published yet
    copy.sync()
    assert copy.layers[0].gate_up_t is mlp and mlp._version == mlp_version  # no adapter: kept
    assert not torch.equal(copy.layers[0].qkv_t, qkv_before)  # rewritten (in place, fp32)
    assert float((_run(copy, rows, [])[0] - _policy_last_logits(model, rows)).abs().max()) < 1e-4
    with torch.no_grad():  # a base weight moves in place (full fine-tuning): seen
        model.get_base_model().model.layers[1].mlp.down_proj.weight.mul_(1.5)
        model.get_base_model().model.norm.weight.add_(0.1)
    copy.sync()
    assert float((_run(copy, rows, [])[0] - _policy_last_logits(model, rows)).abs().max()) < 1e-4
    state = {k: v * 0.9 for k, v in model.state_dict().items() if "lora_A" in k}
    model.load_state_dict(state, strict=False)  # a checkpoint restore is seen too
    copy.sync()
    assert float((_run(copy, rows, [])[0] - _policy_last_logits(model, rows)).abs().max()) < 1e-4


def test_merged_weights_are_peft_merge_rewritten_in_place(tokenizer):
    # The fp32 re-sync writes W^T + s A^T B^T into the copy's own buffers: the same matrices
    # as peft's merge (W + s B A, stacked, transposed) to fp32 rounding of an r-term sum.
    from closedloop.engine.decode_copy import effective_weight

    model = _lora(tokenizer)
    copy = LlamaDecodeCopy(model)
    buffers = [(layer.qkv_t, layer.gate_up_t) for layer in copy.layers]
    for seed in (3, 4):
        _perturb(model, seed=seed, scale=0.3)
        copy.sync()
        for layer, block, (qkv, gate_up) in zip(copy.layers, model.get_base_model().model.layers,
                                                buffers, strict=True):
            att, mlp = block.self_attn, block.mlp
            want = torch.cat([effective_weight(m) for m in (att.q_proj, att.k_proj,
                                                           att.v_proj)]).t()
            torch.testing.assert_close(layer.qkv_t, want, rtol=1e-6, atol=1e-6)
            assert layer.qkv_t is qkv and layer.gate_up_t is gate_up  # no new allocation
            want = torch.cat([effective_weight(mlp.gate_proj), effective_weight(mlp.up_proj)]).t()
            torch.testing.assert_close(layer.gate_up_t, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_copy_shares_no_storage_with_the_policy(tokenizer, precision):
    model = _lora(tokenizer)
    copy = LlamaDecodeCopy(model, precision)
    tensors = [t for layer in copy.layers for t in vars(layer).values() if t is not None]
    tensors += [copy.embed, copy.norm, copy.head_t]
    # bf16 weights are oneDNN-packed where the CPU has native bf16: fresh opaque buffers
    packed = precision == "bfloat16" and onednn_bf16_packing()
    assert any(t.is_mkldnn for t in tensors) == packed
    ours = {t.untyped_storage().data_ptr() for t in tensors if not t.is_mkldnn}
    theirs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert not ours & theirs
    rows = [[5, 17, 300, 41]]
    before = _run(copy, rows, [])[0]
    with torch.no_grad():  # unadapted weights (MLP, head, norms) move in place
        model.get_base_model().model.layers[0].mlp.down_proj.weight.mul_(2.0)
        model.get_base_model().model.embed_tokens.weight.mul_(0.5)
    assert torch.equal(_run(copy, rows, [])[0], before)  # not published yet


def test_a_write_through_data_needs_a_forced_sync(tokenizer):
    model = _lora(tokenizer)
    copy = LlamaDecodeCopy(model)
    rows = [[5, 17, 300, 41]]
    weight = model.get_base_model().model.layers[0].mlp.up_proj.weight
    weight.data = weight.data * 2.0  # a new storage: seen without force
    copy.sync()
    assert float((_run(copy, rows, [])[0] - _policy_last_logits(model, rows)).abs().max()) < 1e-4
    weight.data.mul_(0.5)  # same storage, version counter bypassed
    copy.sync()
    stale = _run(copy, rows, [])[0]
    assert float((stale - _policy_last_logits(model, rows)).abs().max()) > 1e-3
    copy.sync(force=True)
    assert float((_run(copy, rows, [])[0] - _policy_last_logits(model, rows)).abs().max()) < 1e-4


def test_disabling_the_adapter_is_a_change(tokenizer):
    model = _lora(tokenizer)
    copy = LlamaDecodeCopy(model)
    rows = [[5, 17, 300, 41]]
    with model.disable_adapter():
        copy.sync()
        base = _policy_last_logits(model, rows)
    assert float((_run(copy, rows, [])[0] - base).abs().max()) < 1e-4
    copy.sync()
    assert float((_run(copy, rows, [])[0] - _policy_last_logits(model, rows)).abs().max()) < 1e-4


@pytest.mark.parametrize("packing", [True, False], ids=["onednn-packed", "strided"])
def test_bf16_equals_the_module_copy_under_the_same_rule(tokenizer, monkeypatch, packing):
    if packing and not onednn_bf16_packing():
        pytest.skip("this CPU has no native bf16: the strided layout is the only one")
    monkeypatch.setattr(llama_decode, "onednn_bf16_packing", lambda: packing)
    model = _lora(tokenizer)
    rows = [[5, 17, 300, 41, 9], [88, 3]]
    copy = LlamaDecodeCopy(model, "bfloat16")
    assert copy.layers[0].qkv_t.is_mkldnn == packing
    lean = _run(copy, rows, [[7, 8], [9, 10]])
    module = _run(_ModuleCopy(DecodeCopy(model, "bfloat16")), rows, [[7, 8], [9, 10]])
    fp32 = _run(LlamaDecodeCopy(model), rows, [[7, 8], [9, 10]])
    for a, b, c in zip(lean, module, fp32, strict=True):
        assert float((a - b).abs().max()) < 2e-2
        assert float((a - c).abs().max()) > 1e-4  # the bf16 rule is applied


class _ModuleCopy:
    """Adapts ``DecodeCopy``'s module call to ``last_logits``."""

    def __init__(self, copy):
        self.copy = copy

    def last_logits(self, ids, mask, pos, cache):
        with torch.no_grad():
            out = self.copy(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache,
                            use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()


def test_supports_names_what_it_cannot_hold(tokenizer):
    assert supports(build_tiny_model(tokenizer)) is None
    model = build_tiny_model(tokenizer)
    model.config.hidden_act = "gelu"
    assert "activation" in supports(model)
    model = build_tiny_model(tokenizer)
    model.config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    assert "rope" in supports(model)
    model = build_tiny_model(tokenizer)
    model.config.model_type = "mistral"
    assert "Llama" in supports(model)
    with pytest.raises(ValueError, match="activation"):
        bad = build_tiny_model(tokenizer)
        bad.config.hidden_act = "gelu"
        LlamaDecodeCopy(bad)


def test_generator_uses_it_and_samples_as_the_policy(tokenizer, renderer):
    model = _lora(tokenizer)
    prompt = renderer.render_prompt("Repair a.json")
    lean = HFGenerator(model, tokenizer, seed=0)
    assert isinstance(lean._decode, LlamaDecodeCopy)
    module = HFGenerator(model, tokenizer, seed=0, lean_decode=False)
    assert isinstance(module._decode, DecodeCopy)
    plain = HFGenerator(model, tokenizer, seed=0, decode_copy=False)
    outs = [g.generate(prompt, SamplerConfig(), renderer.stop_sequences, 16, seed=3)
            for g in (lean, module, plain)]
    assert outs[0].action_token_ids == outs[1].action_token_ids == outs[2].action_token_ids
    for other in outs[1:]:
        assert max(abs(x - y) for x, y in zip(outs[0].raw_model_logprobs,
                                              other.raw_model_logprobs, strict=True)) < 1e-4


def test_refresh_weights_can_force_a_full_sync(tokenizer, renderer):
    model = _lora(tokenizer)
    prompt = renderer.render_prompt("Repair a.json")
    gen = HFGenerator(model, tokenizer, seed=0)
    plain = HFGenerator(model, tokenizer, seed=0, decode_copy=False)
    greedy = SamplerConfig(greedy=True)
    model.get_base_model().model.layers[0].mlp.up_proj.weight.data.mul_(-3.0)
    want = plain.generate(prompt, greedy, renderer.stop_sequences, 8, seed=0)
    gen.refresh_weights(force=True)
    got = gen.generate(prompt, greedy, renderer.stop_sequences, 8, seed=0)
    assert got.action_token_ids == want.action_token_ids
    assert max(abs(x - y) for x, y in zip(got.raw_model_logprobs, want.raw_model_logprobs,
                                          strict=True)) < 1e-4


@pytest.fixture
def fp32_packing(monkeypatch):
    """Every float32 weight oneDNN-packed, the tiny model's included (SmolLM2's are by size)."""
    if not llama_decode.onednn_fp32_packing():
        pytest.skip("torch has no oneDNN here: float32 weights stay strided")
    monkeypatch.setattr(llama_decode, "FP32_PACK_MIN_WIDTH", 1)


def test_fp32_packing_is_chosen_by_weight_size(tokenizer):
    copy = LlamaDecodeCopy(_lora(tokenizer))
    assert not any(t.is_mkldnn for t in vars(copy.layers[0]).values() if t is not None)
    big = torch.zeros(576, 576)  # SmolLM2's smallest projection
    assert copy._packs(big, (576, 576)) == llama_decode.onednn_fp32_packing()
    assert not copy._packs(big, (64, 49152))  # a tiny model's vocabulary projection
    bf16 = LlamaDecodeCopy(_lora(tokenizer), "bfloat16")  # packed where bf16 is native
    assert bf16._packs(big, (64, 64)) == llama_decode.onednn_bf16_packing()


@pytest.mark.parametrize("kv_heads", [None, 4], ids=["gqa", "mha"])
def test_fp32_packed_prefill_and_decode_equal_the_policy(tokenizer, kv_heads, fp32_packing):
    model = _lora(tokenizer, kv_heads=kv_heads)
    copy = LlamaDecodeCopy(model)
    assert copy.layers[0].qkv_t.is_mkldnn and copy.layers[0].down_t.is_mkldnn
    assert copy.head_t.is_mkldnn
    rows = [[5, 17, 300, 41, 9, 77, 12], [88, 3], [1000, 2000, 30, 4]]
    steps = [[7, 8, 9], [11, 12, 13], [400, 500, 600]]
    got = _run(copy, rows, steps)
    plain = LlamaDecodeCopy(model, packed=False)
    assert not plain.layers[0].qkv_t.is_mkldnn
    strided = _run(plain, rows, steps)
    for k, logits in enumerate(got):
        want = _policy_last_logits(model, [r + [s[b] for s in steps[:k]]
                                           for b, r in enumerate(rows)])
        assert float((logits - want).abs().max()) < 1e-4, k
        assert float((logits - strided[k]).abs().max()) < 1e-4, k


def test_fp32_packed_resync_merges_into_reused_buffers(tokenizer, fp32_packing):
    model = _lora(tokenizer)
    copy = LlamaDecodeCopy(model)
    rows = [[5, 17, 300, 41], [88, 3, 2, 1]]
    scratch = dict(copy._scratch)
    assert scratch  # the adapted blocks were merged through it
    for seed in (3, 4):
        before = _run(copy, rows, [])[0]
        _perturb(model, seed=seed, scale=0.3)
        assert torch.equal(_run(copy, rows, [])[0], before)  # the policy's tensors: not shared
        copy.sync()
        assert all(copy._scratch[k] is v for k, v in scratch.items())  # no new buffers
        after = _run(copy, rows, [])[0]
        assert float((after - _policy_last_logits(model, rows)).abs().max()) < 1e-4
        for buf in copy._scratch.values():
            buf.fill_(7.0)  # the packed weights are copies of the buffers
        assert torch.equal(_run(copy, rows, [])[0], after)


def test_bf16_packed_resync_rounds_the_merge_once_in_reused_buffers(tokenizer):
    """Where the CPU has native bf16, a re-sync merges ``W + s B A`` in a reused float32 buffer,
    rounds it once into a reused bf16 buffer and packs from that: the same weights a copy
    built from scratch holds, no new buffers, and the packed weights are copies."""
    if not onednn_bf16_packing():
        pytest.skip("this CPU has no native bf16: bf16 weights stay strided")
    model = _lora(tokenizer)
    copy = LlamaDecodeCopy(model, "bfloat16")
    rows = [[5, 17, 300, 41], [88, 3, 2, 1]]
    scratch = dict(copy._scratch)
    assert {dtype for _, dtype in scratch} == {torch.float32, torch.bfloat16}
    for seed in (3, 4):
        _perturb(model, seed=seed, scale=0.3)
        copy.sync()
        assert all(copy._scratch[k] is v for k, v in scratch.items())  # no new buffers
        after = _run(copy, rows, [])[0]
        assert torch.equal(after, _run(LlamaDecodeCopy(model, "bfloat16"), rows, [])[0])
        module = _run(_ModuleCopy(DecodeCopy(model, "bfloat16")), rows, [])[0]
        assert float((after - module).abs().max()) < 2e-2
        for buf in copy._scratch.values():
            buf.fill_(7.0)
        assert torch.equal(_run(copy, rows, [])[0], after)


def test_the_generator_can_keep_the_weights_strided(tokenizer, renderer, fp32_packing):
    model = _lora(tokenizer)
    prompt = renderer.render_prompt("Repair a.json")
    packed = HFGenerator(model, tokenizer, seed=0)
    strided = HFGenerator(model, tokenizer, seed=0, packed_weights=False)
    assert packed._decode.layers[0].qkv_t.is_mkldnn
    assert not strided._decode.layers[0].qkv_t.is_mkldnn
    outs = [g.generate(prompt, SamplerConfig(), renderer.stop_sequences, 16, seed=3)
            for g in (packed, strided)]
    assert outs[0].action_token_ids == outs[1].action_token_ids
    assert max(abs(x - y) for x, y in zip(outs[0].raw_model_logprobs, outs[1].raw_model_logprobs,
                                          strict=True)) < 1e-4


def test_a_padded_prefill_multiplies_only_its_real_ids(tokenizer, monkeypatch):
    """Rows of unequal length prefill as one packed matrix of their real ids (the padding
    never reaches a projection), with the policy's logits (``_run`` checks them above)."""
    model = _lora(tokenizer)
    copy = LlamaDecodeCopy(model)
    rows = [[5, 17, 300, 41, 9, 77, 12], [88, 3], [1000, 2000, 30, 4]]
    seen = []
    product = copy._mm
    monkeypatch.setattr(copy, "_mm", lambda x, *a: (seen.append(x.shape[:-1]), product(x, *a))[1])
    got = _run(copy, rows, [])[0]
    assert seen[0] == (sum(map(len, rows)),)  # the first layer's q/k/v product
    assert all(shape in ((13,), (3, 1)) for shape in seen)  # the head: last positions only
    assert float((got - _policy_last_logits(model, rows)).abs().max()) < 1e-4
    padded = LlamaDecodeCopy(model, packed_prefill=False)  # the comparison switch: same logits
    assert torch.allclose(_run(padded, rows, [])[0], got, atol=1e-5, rtol=0)
