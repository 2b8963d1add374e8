"""Shared-prefix log-probs equal the unshared ones (values, LoRA gradients, reference pass),
on the packed one-call layout, with the sdpa and the eager attention."""

from contextlib import contextmanager

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from closedloop.engine import (
    LogprobInputError,
    common_prefix_lengths,
    prompt_prefix_lengths,
    sequence_logprobs,
    shared_prefix_logprobs,
)
from closedloop.engine.logprobs import _decoder_and_head
from closedloop.engine.packed_prefix import suffix_buckets
from closedloop.policy import attach_lora, build_tiny_model

PROMPT_LENS = (7, 11, 9)  # three groups of four siblings; then one row with its own prompt


def lora_model(tokenizer, attn="sdpa"):
    """Tiny peaked Llama + LoRA whose B matrices are non-zero, so the adapter matters."""
    model = attach_lora(build_tiny_model(tokenizer, seed=3, init_std=0.3,
                                         attn_implementation=attn), r=4, alpha=8, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return model


@pytest.fixture(scope="module")
def model(tokenizer):
    return lora_model(tokenizer)


def grouped_rows(seed=0):
    """Right-padded rows: prompt + action + observation + action, targets on actions only.

    Returns (ids [13, T], attn [13, T], shifted target mask [13, T-1], prompt lengths [13]).
    Siblings share their prompt ids exactly; suffix lengths differ within each group.
    """
    g = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(10, 5000, (n,), generator=g).tolist()

    rows, prompts = [], []
    for plen in (*PROMPT_LENS, 5):
        prompt = rand(plen)
        for k in range(4 if plen != 5 else 1):
            a1, obs, a2 = rand(2 + k), rand(k % 3), rand(1 + (k * 2) % 5) if k % 2 else []
            rows.append((prompt, a1, obs, a2))
            prompts.append(plen)
    length = max(sum(len(part) for part in r) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    attn = torch.zeros_like(ids)
    act = torch.zeros(len(rows), length)
    for i, parts in enumerate(rows):
        at = 0
        for j, part in enumerate(parts):
            ids[i, at:at + len(part)] = torch.tensor(part, dtype=torch.long)
            attn[i, at:at + len(part)] = 1
            if j in (1, 3):
                act[i, at:at + len(part)] = 1
            at += len(part)
    return ids, attn, act[:, 1:], torch.tensor(prompts)


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def test_prompt_prefix_lengths_is_the_prompt_before_the_first_action():
    # row 0: first target at t=2 -> predicts x[3], so the prompt is x[:3]; row 1: no target.
    mask = torch.tensor([[0, 0, 1, 1, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]])
    assert prompt_prefix_lengths(mask).tolist() == [3, 0, 1]
    _, _, target, prompts = grouped_rows()
    assert prompt_prefix_lengths(target).tolist() == prompts.tolist()


def test_common_prefix_lengths_is_the_shared_prompt_head():
    ids = torch.tensor([[5, 6, 7, 8, 9, 0], [5, 6, 7, 3, 9, 9], [5, 6, 4, 4, 4, 4]])
    attn = (ids != 0).long()
    target = torch.tensor([[0, 0, 0, 1, 0], [0, 0, 0, 0, 1], [0, 0, 0, 1, 1]])
    # first targets predict x[4], x[5], x[4]: prompts of 4, 5, 4 ids; rows share [5, 6]
    assert common_prefix_lengths(ids, attn, target).tolist() == [2, 2, 2]
    # identical prompts: the whole shortest prompt is shared, never past a first target
    assert common_prefix_lengths(ids[:1].repeat(3, 1), attn[:1].repeat(3, 1),
                                 target[:1].repeat(3, 1)).tolist() == [4, 4, 4]
    # a row without targets does not constrain the prefix (it is not scored: 0)
    no_target = target.clone()
    no_target[2] = 0
    assert common_prefix_lengths(ids, attn, no_target).tolist() == [3, 3, 0]
    # one row shares its whole prompt with itself; no target anywhere or nothing shared: 0
    assert common_prefix_lengths(ids[[0]], attn[[0]], target[[0]]).tolist() == [4]
    assert common_prefix_lengths(ids, attn, target * 0).tolist() == [0, 0, 0]
    other = ids.clone()
    other[1, 0] = 99
    assert common_prefix_lengths(other, attn, target).tolist() == [0, 0, 0]


def test_common_prefix_scoring_of_different_prompts_equals_the_unshared_path(model):
    """Rows of different prompts that share a head (one system message, other tasks): forwarding
    the head once gives the unshared values and LoRA gradients."""
    ids, mask, target, _ = grouped_rows(seed=6)
    ids[:, :4] = torch.tensor([11, 12, 13, 14])  # every prompt opens with the same 4 ids
    p = common_prefix_lengths(ids, mask, target)
    assert p.tolist() == [4] * ids.shape[0]
    w = torch.randn(target.shape, generator=torch.Generator().manual_seed(8))
    params = trainable(model)
    want_lp = sequence_logprobs(model, ids, mask, target)
    got_lp = shared_prefix_logprobs(model, ids, mask, target, prefix_len_B=p)
    torch.testing.assert_close(got_lp, want_lp, rtol=1e-5, atol=1e-5)
    want = torch.autograd.grad((want_lp * w).sum(), params)
    got = torch.autograd.grad((got_lp * w).sum(), params)
    for g_want, g_got in zip(want, got, strict=True):
        scale = float(g_want.abs().max())
        torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_values_equal_the_unshared_path(tokenizer, model, attn):
    m = model if attn == "sdpa" else lora_model(tokenizer, attn)
    ids, mask, target, _ = grouped_rows()
    with torch.no_grad():
        want = sequence_logprobs(m, ids, mask, target)
        got = shared_prefix_logprobs(m, ids, mask, target)
    assert int((want != 0).sum()) == int(target.sum())  # every action token is scored
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert bool((got[target == 0] == 0).all())


def test_gradients_equal_the_unshared_path(model):
    ids, mask, target, _ = grouped_rows(seed=1)
    w = torch.randn(target.shape, generator=torch.Generator().manual_seed(7))
    params = trainable(model)
    want = torch.autograd.grad((sequence_logprobs(model, ids, mask, target) * w).sum(), params)
    got = torch.autograd.grad((shared_prefix_logprobs(model, ids, mask, target) * w).sum(),
                              params)
    assert len(params) == 16  # q, k, v, o LoRA A and B in 2 layers
    for g_want, g_got in zip(want, got, strict=True):
        scale = float(g_want.abs().max())
        assert scale > 1e-4
        torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-5 * scale)


def test_reference_pass_without_the_adapter_equals_the_unshared_path(model):
    ids, mask, target, _ = grouped_rows(seed=2)
    with torch.no_grad():
        adapted = shared_prefix_logprobs(model, ids, mask, target)
        with model.disable_adapter():
            want = sequence_logprobs(model, ids, mask, target)
            got = shared_prefix_logprobs(model, ids, mask, target)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert float((adapted - got).abs().max()) > 1e-2  # the adapter changes the scores


def test_explicit_prefixes_targets_inside_them_and_plain_rows(model):
    # Prefixes shorter than the prompt (targets at t < p - 1 read the prefix pass), rows with
    # p = 0 (the plain path), a target-free row (never forwarded) all agree with the reference.
    ids, mask, _, prompts = grouped_rows(seed=3)
    target = (mask[:, :-1] & mask[:, 1:]).float()
    target[5] = 0
    p = (prompts - 3).clamp(min=0)
    p[[0, 12]] = 0
    with torch.no_grad():
        want = sequence_logprobs(model, ids, mask, target)
        got = shared_prefix_logprobs(model, ids, mask, target, prefix_len_B=p)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert bool((got[5] == 0).all())


def test_each_distinct_prompt_is_forwarded_once(model):
    ids, mask, target, prompts = grouped_rows(seed=4)
    decoder, _ = _decoder_and_head(model)
    fed = []  # (query slots, real query tokens) per decoder call

    def count(_module, _args, kwargs):
        q = kwargs["input_ids"].shape[1]
        att = kwargs["attention_mask"]
        real = q * kwargs["input_ids"].shape[0] if att is None else int(att[:, -q:].sum())
        fed.append((kwargs["input_ids"].numel(), real))

    handle = decoder.register_forward_pre_hook(count, with_kwargs=True)
    try:
        with torch.no_grad():
            shared_prefix_logprobs(model, ids, mask, target)
            shared_calls = len(fed)
            sequence_logprobs(model, ids, mask, target)
    finally:
        handle.remove()
    real = int(mask.sum())
    # 13 rows: the prompts are fed once per distinct prompt (7 + 11 + 9 + 5), not per row.
    once = real - int(prompts.sum()) + sum((*PROMPT_LENS, 5))
    assert sum(r for _, r in fed[:shared_calls]) == once
    assert fed[shared_calls] == (ids.numel(), real)
    assert fed[:shared_calls] == [(once, once)]  # one call, no padding at all


def test_invalid_prefixes_are_refused(model):
    ids, mask, target, prompts = grouped_rows()
    too_long = prompts.clone()
    too_long[3] = int(mask[3].sum())  # nothing left after the prefix
    with pytest.raises(LogprobInputError, match="at least one real token"):
        shared_prefix_logprobs(model, ids, mask, target, prefix_len_B=too_long)
    left = torch.flip(mask, [1])  # left padding: the prefix would start on padding
    with pytest.raises(LogprobInputError, match="right-padded"):
        shared_prefix_logprobs(model, torch.flip(ids, [1]), left, target.flip(1),
                               prefix_len_B=prompts)


def test_an_attention_that_cannot_pack_is_refused(model, monkeypatch):
    ids, mask, target, _ = grouped_rows()
    decoder, _ = _decoder_and_head(model)
    monkeypatch.setattr(decoder.config, "_attn_implementation", "flash_attention_2")
    with pytest.raises(LogprobInputError, match="sdpa or eager"), torch.no_grad():
        shared_prefix_logprobs(model, ids, mask, target)


def test_packed_call_restores_the_attention_implementation(model, monkeypatch):
    ids, mask, target, _ = grouped_rows()
    decoder, _ = _decoder_and_head(model)
    with torch.no_grad():
        shared_prefix_logprobs(model, ids, mask, target)
    assert decoder.config._attn_implementation == "sdpa"

    def broken(*_args, **_kwargs):
        raise RuntimeError("attention failed")

    from closedloop.engine import packed_prefix
    monkeypatch.setattr(packed_prefix, "packed_attention", broken)
    with pytest.raises(RuntimeError, match="attention failed"), torch.no_grad():
        shared_prefix_logprobs(model, ids, mask, target)
    assert decoder.config._attn_implementation == "sdpa"  # restored on error too
    monkeypatch.undo()
    with torch.no_grad():  # and the next call registers the real function again
        torch.testing.assert_close(shared_prefix_logprobs(model, ids, mask, target),
                                   sequence_logprobs(model, ids, mask, target),
                                   rtol=1e-5, atol=1e-5)


@settings(max_examples=16, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.lists(st.integers(1, 7), min_size=1, max_size=4)),
                min_size=1, max_size=4), st.integers(0, 2**16),
       st.sampled_from([(0, 0.0), (0, 0.5), (4096, 0.05)]))
def test_packed_layout_equals_the_unshared_path_for_any_grouping(model, groups, seed, waste):
    # groups: (prompt length, suffix lengths of its rows); every suffix token is a target.
    # waste: the bucketing's slack: none (a bucket per shape), some, the default (one bucket).
    from closedloop.engine import packed_prefix

    g = torch.Generator().manual_seed(seed)
    rows = []
    for plen, suffixes in groups:
        prompt = torch.randint(10, 5000, (plen,), generator=g).tolist()
        rows += [(prompt, torch.randint(10, 5000, (n,), generator=g).tolist()) for n in suffixes]
    width = max(len(p) + len(s) for p, s in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    target = torch.zeros(len(rows), width - 1)  # width >= 2: p, n >= 1
    for i, (p, s) in enumerate(rows):
        ids[i, :len(p) + len(s)] = torch.tensor(p + s)
        mask[i, :len(p) + len(s)] = 1
        target[i, len(p) - 1:len(p) + len(s) - 1] = 1
    with torch.no_grad():
        want = sequence_logprobs(model, ids, mask, target)
        with _waste(packed_prefix, *waste):
            got = shared_prefix_logprobs(model, ids, mask, target)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@contextmanager
def _waste(module, pairs, share):
    saved = module.WASTE_PAIRS, module.WASTE_SHARE
    module.WASTE_PAIRS, module.WASTE_SHARE = pairs, share
    try:
        yield
    finally:
        module.WASTE_PAIRS, module.WASTE_SHARE = saved


@pytest.mark.parametrize("waste", [(0, 0.0), (0, 0.5), (4096, 0.05)],
                         ids=["per-shape", "some-padding", "default"])
def test_bucketed_suffix_gradients_equal_the_unshared_path(model, waste):
    # Siblings of very different lengths over two prompts: per-shape buckets, mixed buckets
    # (rows of different prefixes and lengths padded together) and the default give the
    # unshared LoRA gradients.
    from closedloop.engine import packed_prefix

    g = torch.Generator().manual_seed(5)
    rows = []
    for plen, suffixes in ((6, (2, 9, 9, 4)), (3, (1, 7))):
        prompt = torch.randint(10, 5000, (plen,), generator=g).tolist()
        rows += [(prompt, torch.randint(10, 5000, (n,), generator=g).tolist()) for n in suffixes]
    width = max(len(p) + len(s) for p, s in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    target = torch.zeros(len(rows), width - 1)
    for i, (p, s) in enumerate(rows):
        ids[i, :len(p) + len(s)] = torch.tensor(p + s)
        mask[i, :len(p) + len(s)] = 1
        target[i, len(p) - 1:len(p) + len(s) - 1] = 1
    params = trainable(model)
    w = torch.randn(target.shape, generator=g)
    want = torch.autograd.grad((sequence_logprobs(model, ids, mask, target) * w).sum(), params)
    with _waste(packed_prefix, *waste):
        buckets = packed_prefix.suffix_buckets([6] * 4 + [3] * 2, [2, 9, 9, 4, 1, 7])
        got = torch.autograd.grad((shared_prefix_logprobs(model, ids, mask, target) * w).sum(),
                                  params)
    if waste == (0, 0.0):
        assert sorted(map(len, buckets)) == [1, 1, 1, 1, 2]  # one per shape: (6, 9) twice
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_suffix_buckets_pad_short_rows_together_and_keep_long_ones_apart():
    # 32-id replies on a 95-id prompt: one call (padding costs less than a call);
    # multi-turn episodes 200-400 ids long on a 345-id prompt: apart unless nearly equal.
    assert suffix_buckets([95] * 4, [20, 32, 27, 31]) == [[0, 2, 3, 1]]
    assert suffix_buckets([345] * 4, [200, 361, 361, 272]) == [[0], [3], [1, 2]]
    assert suffix_buckets([345] * 3, [300, 301, 400]) == [[0, 1], [2]]
