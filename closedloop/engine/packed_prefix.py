"""One decoder call over unpadded tokens for rows that share prompt prefixes (exact).

``shared_prefix_logprobs``' layout without padding in the dense work. The decoder sees one row of
``N = sum_u p_u + sum_s n_s`` tokens: every distinct prefix once (``u = 0..U-1``, ``p_u`` ids),
then every row's suffix (``s = 0..S-1``, ``n_s`` ids), with explicit positions (``0..p_u-1`` for
a prefix, ``p_s..p_s+n_s-1`` for a suffix). The projections, MLPs and norms run on the ``N``
real tokens only; attention runs on gathered views.

Attention is the one part that must see the grouping. ``packed_attention`` is registered with
transformers' ``AttentionInterface`` and is switched on for the duration of one call
(``packed_decoder_call``). In each layer it gathers, from the packed queries/keys/values:

- the prefixes, right-padded to ``L = max p_u``: ``[U, H, L, D]``, causal (a real query sees
  only real keys, since the padding is on the right);
- the suffixes in buckets (``suffix_buckets``: rows of one shape together, a short row joining
  others when padding it costs less than a call): queries ``[R, H, n, D]`` against the keys
  of their own prefix (``p`` slots, those past the row's own prefix masked) followed by their
  own suffix (causal). A row's attention then costs about ``n (p + n)`` whatever its siblings'
  lengths (padding every suffix of a micro-batch to the longest cost the multi-turn batches
  ~40% of their suffix attention, forward and backward);

runs torch's ``scaled_dot_product_attention`` on each (for a model set to ``sdpa`` or ``eager``,
which compute the same function), and scatters the real rows back to packed order. Pad slots
are gathered from a real token of the same segment, so every value is finite; every query
sees at least one real key (its prefix has ``p >= 1``), so no softmax row is empty. The gathers are
``index_select`` (their backward sums the siblings' cotangents into their shared prefix keys and
values). The result equals the unshared ``sequence_logprobs`` up to floating-point summation
order.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

PACKED_ATTENTION = "closedloop_packed_prefix"
SUPPORTED_ATTENTION = ("sdpa", "eager")


@dataclass(frozen=True)
class SuffixBucket:
    """Suffix rows attended in one call, padded to the bucket's longest prefix ``p`` and suffix
    ``n`` (rows of one shape need no padding; ``suffix_buckets`` decides).

    ``q_idx_R_n``: packed index of each query slot; ``kv_idx_R_K``: packed index of each key it
    attends to (``K = p + n``: its own prefix's slots, then its own suffix's); ``mask_R_n_K``:
    which keys a query sees (its prefix's real keys, and suffix keys up to its own position).
    Pad slots are gathered from a real token of the same segment.
    """

    q_idx_R_n: torch.Tensor
    kv_idx_R_K: torch.Tensor
    mask_R_n_K: torch.Tensor


WASTE_PAIRS = 4096
"""Padded query-key pairs a bucket may add to save an attention call (~0.4 ms of call overhead
against ~0.12 us a pair on a 2-core CPU, forward and backward: short single-turn replies share
a call; multi-turn episodes, hundreds of ids apart, do not)."""
WASTE_SHARE = 0.05
"""... or this share of the bucket's real pairs, whichever is larger."""


def suffix_buckets(p_S: list[int], n_S: list[int]) -> list[list[int]]:
    """Suffix rows grouped for attention, each group padded to its longest ``p`` and ``n``.

    Rows in order of ``(n, p)``; a row joins the current group while the group's padded work
    ``R max n (max p + max n)`` exceeds its real work ``sum n (p + n)`` by at most
    ``max(WASTE_PAIRS, WASTE_SHARE * real)`` query-key pairs, else starts a new group.
    """
    order = sorted(range(len(n_S)), key=lambda s: (n_S[s], p_S[s]))
    groups: list[list[int]] = []
    real = p_max = n_max = 0  # the current group's real pairs and its longest p and n
    for s in order:
        cost = n_S[s] * (p_S[s] + n_S[s])
        if groups:
            p, n = max(p_max, p_S[s]), max(n_max, n_S[s])
            waste = (len(groups[-1]) + 1) * n * (p + n) - (real + cost)
            if waste <= max(WASTE_PAIRS, WASTE_SHARE * (real + cost)):
                groups[-1].append(s)
                real, p_max, n_max = real + cost, p, n
                continue
        groups.append([s])
        real, p_max, n_max = cost, p_S[s], n_S[s]
    return groups


@dataclass(frozen=True)
class PackedLayout:
    """Index maps between the packed row and the attention views (module doc).

    ``pre_idx_U_L``: packed index of each padded prefix slot (the prefixes are causal);
    ``buckets``: the suffixes grouped for attention (``SuffixBucket``, ``suffix_buckets``);
    ``out_idx_N``: for packed token ``i``, its row in ``cat(prefix out [U*L], each bucket's out
    [R*n] in order)``.
    """

    pre_idx_U_L: torch.Tensor
    buckets: tuple[SuffixBucket, ...]
    out_idx_N: torch.Tensor
    ids_N: torch.Tensor
    positions_N: torch.Tensor
    pre_start_U: torch.Tensor
    suf_start_S: torch.Tensor


def packed_layout(pre_ids_U_L: torch.Tensor, pre_len_U: torch.Tensor, suf_ids_S_Ls: torch.Tensor,
                  suf_len_S: torch.Tensor, inv_S: torch.Tensor) -> PackedLayout:
    """Build the layout from right-padded prefixes/suffixes and ``inv_S`` (row -> its prefix).

    Every ``p_u`` and ``n_s`` must be >= 1. Suffixes are attended in ``suffix_buckets``, so a
    row's attention costs about ``n (p + n)`` query-key pairs, not ``max n (max p + max n)``
    over every row (siblings of one prompt differ in length, multi-turn episodes by hundreds of
    ids).
    """
    device = pre_ids_U_L.device
    u_count, length = pre_ids_U_L.shape
    ar_L = torch.arange(length, device=device)
    ar_Ls = torch.arange(suf_ids_S_Ls.shape[1], device=device)
    pre_real_U_L = ar_L[None, :] < pre_len_U[:, None]
    suf_real_S_Ls = ar_Ls[None, :] < suf_len_S[:, None]
    pre_start_U = torch.cumsum(pre_len_U, 0) - pre_len_U
    n_pre = int(pre_len_U.sum())
    suf_start_S = n_pre + torch.cumsum(suf_len_S, 0) - suf_len_S
    pre_idx_U_L = pre_start_U[:, None] + torch.minimum(ar_L[None, :], pre_len_U[:, None] - 1)
    pre_len_S, pre_start_S = pre_len_U.index_select(0, inv_S), pre_start_U.index_select(0, inv_S)
    p_S, n_S = pre_len_S.tolist(), suf_len_S.tolist()
    buckets, suf_out_S = [], [0] * len(n_S)
    offset = u_count * length
    for rows in suffix_buckets(p_S, n_S):
        idx = torch.tensor(rows, device=device)
        p, n = max(p_S[s] for s in rows), max(n_S[s] for s in rows)
        p_R, n_R = pre_len_S[idx], suf_len_S[idx]
        q = suf_start_S[idx][:, None] + torch.minimum(ar_Ls[None, :n], n_R[:, None] - 1)
        pre = pre_start_S[idx][:, None] + torch.minimum(ar_L[None, :p], p_R[:, None] - 1)
        mask = torch.cat([(ar_L[None, :p] < p_R[:, None])[:, None, :].expand(-1, n, -1),
                          (ar_Ls[:n, None] >= ar_Ls[None, :n])[None].expand(len(rows), -1, -1)],
                         dim=2)
        buckets.append(SuffixBucket(q, torch.cat([pre, q], dim=1), mask))
        for r, s in enumerate(rows):
            suf_out_S[s] = offset + r * n
        offset += len(rows) * n
    suf_out_S_Ls = torch.tensor(suf_out_S, device=device)[:, None] + ar_Ls[None, :]
    out_idx_N = torch.cat([
        (torch.arange(u_count, device=device)[:, None] * length + ar_L[None, :])[pre_real_U_L],
        suf_out_S_Ls[suf_real_S_Ls]])
    ids_N = torch.cat([pre_ids_U_L[pre_real_U_L], suf_ids_S_Ls[suf_real_S_Ls]])
    positions_N = torch.cat([ar_L[None, :].expand(u_count, -1)[pre_real_U_L],
                             (pre_len_S[:, None] + ar_Ls[None, :])[suf_real_S_Ls]])
    return PackedLayout(pre_idx_U_L, tuple(buckets), out_idx_N, ids_N, positions_N,
                        pre_start_U, suf_start_S)


def packed_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention over the packed row ``[1, H, N, D]`` -> ``[1, N, H, D]`` (module doc).

    ``kwargs`` carries ``closedloop_layout`` (a ``PackedLayout``). Every view goes through
    ``torch.nn.functional.scaled_dot_product_attention`` with grouped-query heads left grouped
    (``enable_gqa``: no key/value copy per query head): the prefixes with ``is_causal`` (under
    right padding a real query only sees real keys), each suffix bucket with its mask.
    """
    layout: PackedLayout = kwargs["closedloop_layout"]
    q_H_N_D, k_H_N_D, v_H_N_D = query[0], key[0], value[0]
    gqa = q_H_N_D.shape[0] != k_H_N_D.shape[0]

    def view(t_H_N_D: torch.Tensor, idx_R_C: torch.Tensor) -> torch.Tensor:
        rows, cols = idx_R_C.shape
        picked = t_H_N_D.index_select(1, idx_R_C.reshape(-1))
        return picked.view(t_H_N_D.shape[0], rows, cols, -1).transpose(0, 1)

    sdpa = torch.nn.functional.scaled_dot_product_attention
    outs = [sdpa(view(q_H_N_D, layout.pre_idx_U_L), view(k_H_N_D, layout.pre_idx_U_L),
                 view(v_H_N_D, layout.pre_idx_U_L), dropout_p=dropout, is_causal=True,
                 scale=scaling, enable_gqa=gqa)]
    outs += [sdpa(view(q_H_N_D, b.q_idx_R_n), view(k_H_N_D, b.kv_idx_R_K),
                  view(v_H_N_D, b.kv_idx_R_K), attn_mask=b.mask_R_n_K[:, None],
                  dropout_p=dropout, scale=scaling, enable_gqa=gqa) for b in layout.buckets]
    heads, dim = outs[0].shape[1], outs[0].shape[-1]
    both = torch.cat([o.transpose(1, 2).reshape(-1, heads, dim) for o in outs])
    return both.index_select(0, layout.out_idx_N)[None], None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)


def packs(decoder: Any) -> bool:
    """Whether ``decoder``'s attention implementation can run ``packed_decoder_call``."""
    config = getattr(decoder, "config", None)
    return getattr(config, "_attn_implementation", None) in SUPPORTED_ATTENTION


@contextmanager
def _attention_switched(config: Any) -> Iterator[None]:
    """Switch ``config`` to the packed attention for one call, and back."""
    original = config._attn_implementation
    _register()
    config._attn_implementation = PACKED_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = original


def packed_decoder_call(decoder: Any, layout: PackedLayout) -> torch.Tensor:
    """Run ``decoder`` once over the packed row; return its hidden states ``[N, H]``.

    ``decoder`` must satisfy ``packs(decoder)``; its config is restored afterwards even on error.
    The switch is on the model's config, so no other forward of the same model may run
    concurrently (the trainer and the generator's own decode copy never share one).
    """
    with _attention_switched(decoder.config):
        out = decoder(input_ids=layout.ids_N[None], attention_mask=None,
                      position_ids=layout.positions_N[None], use_cache=False,
                      closedloop_layout=layout)
    return out.last_hidden_state[0]
