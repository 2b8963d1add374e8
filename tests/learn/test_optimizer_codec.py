"""The optimizer state codec: a real optimizer's state round-trips bit for bit with its
types, any JSON-like structure round-trips (hypothesis), and what it cannot store is refused
by path."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from closedloop.learn.optimizer_codec import decode_optimizer_state, encode_optimizer_state


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a,
                                b.view(-1).view(torch.uint8) if b.numel() else b))
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_adamw_state_round_trips_and_the_optimizer_resumes_identically() -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 5)), torch.nn.Parameter(torch.randn(3))]
    opt = torch.optim.AdamW(params, lr=0.01, betas=(0.8, 0.95), weight_decay=0.1)
    for _ in range(3):
        opt.zero_grad()
        (params[0].sum() ** 2 + params[1].pow(3).sum()).backward()
        opt.step()
    state = opt.state_dict()
    back = decode_optimizer_state(encode_optimizer_state(state))
    assert _same(state, back)
    assert back["param_groups"][0]["betas"] == (0.8, 0.95)
    assert set(back["state"]) == {0, 1}  # parameter indices stay ints
    # a copy of the optimizer restored from the bytes takes the same next step
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = torch.optim.AdamW(copies, lr=0.01)
    twin.load_state_dict(back)
    for group in (params, copies):
        for p in group:
            p.grad = torch.ones_like(p)
    opt.step()
    twin.step()
    assert all(torch.equal(p, q) for p, q in zip(params, copies, strict=True))


def test_restored_tensors_are_copies_not_views_of_one_buffer() -> None:
    state = {"state": {0: {"a": torch.zeros(4)}, 1: {"a": torch.zeros(4)}}}
    back = decode_optimizer_state(encode_optimizer_state(state))
    back["state"][0]["a"].add_(1.0)
    assert torch.equal(back["state"][1]["a"], torch.zeros(4))


def test_an_empty_state_and_a_fresh_optimizer_round_trip() -> None:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    assert _same(opt.state_dict(), decode_optimizer_state(
        encode_optimizer_state(opt.state_dict())))
    assert decode_optimizer_state(encode_optimizer_state({})) == {}


_DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool]
_tensors = st.builds(
    lambda shape, dtype, seed: (torch.Generator().manual_seed(seed), shape, dtype),
    st.lists(st.integers(0, 3), max_size=3), st.sampled_from(_DTYPES), st.integers(0, 99),
).map(lambda a: (torch.rand(a[1], generator=a[0]) * 10).to(a[2]))
_leaves = st.one_of(st.none(), st.booleans(), st.integers(-2**62, 2**62),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5),
                    _tensors)
_trees = st.recursive(_leaves, lambda kids: st.one_of(
    st.lists(kids, max_size=3), st.lists(kids, max_size=3).map(tuple),
    st.dictionaries(st.one_of(st.integers(-5, 5), st.text(max_size=3)), kids, max_size=3)),
    max_leaves=12)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.text(max_size=4), _trees, max_size=4))
def test_any_structure_round_trips_with_its_types(state: dict) -> None:
    assert _same(state, decode_optimizer_state(encode_optimizer_state(state)))


def test_what_it_cannot_store_is_refused_with_its_path() -> None:
    with pytest.raises(TypeError, match=r"state_dict\['state'\]\[0\]\['f'\].*set"):
        encode_optimizer_state({"state": {0: {"f": {1, 2}}}})
    with pytest.raises(TypeError, match="key"):
        encode_optimizer_state({"state": {(1, 2): 0}})


def test_bytes_that_are_not_its_format_are_refused() -> None:
    from safetensors.torch import save

    with pytest.raises(ValueError, match="format"):
        decode_optimizer_state(save({"x": torch.zeros(1)}, metadata={"format": "other"}))
    with pytest.raises(ValueError):
        decode_optimizer_state(b"\x05")
    good = encode_optimizer_state({"a": torch.zeros(3)})
    with pytest.raises(ValueError):
        decode_optimizer_state(good[:9] + b"X" + good[10:])  # the header's JSON
    with pytest.raises(ValueError):
        decode_optimizer_state(good[:-4])  # the body cut short
