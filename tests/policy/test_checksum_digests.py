"""One walk for a state dict's checksum and its per-tensor digests: the same values as the
two recipes on their own, for any state dict (hypothesis) and for a LoRA policy's worker."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from closedloop.policy import attach_lora
from closedloop.policy.lora import PolicyChecksummer, split_state_dict
from closedloop.policy.tiny_model import build_tiny_model
from closedloop.policy.weights import checksum_and_digests, state_dict_checksum, tensor_digests

_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]
_tensor = st.builds(
    lambda shape, dtype, seed: (torch.rand(shape, generator=torch.Generator().manual_seed(
        seed)) * 7).to(dtype),
    st.lists(st.integers(0, 4), max_size=3), st.sampled_from(_DTYPES), st.integers(0, 999))


@settings(max_examples=120, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=6), _tensor, max_size=6))
def test_one_walk_equals_the_two_recipes(state: dict[str, torch.Tensor]) -> None:
    assert checksum_and_digests(state) == (state_dict_checksum(state), tensor_digests(state))


def test_a_policy_checksummer_gives_digests_of_what_it_holds_now(tokenizer) -> None:
    model = attach_lora(build_tiny_model(tokenizer, seed=0), seed=1)
    summer = PolicyChecksummer(model)
    held, digests = summer.with_digests()
    adapter = split_state_dict(model)[1]
    assert held == summer() and digests == tensor_digests(adapter)
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n)[0, 0] += 1.0
    moved, moved_digests = summer.with_digests()
    assert moved == summer() != held
    assert sum(moved_digests[k] != digests[k] for k in digests) == 1
