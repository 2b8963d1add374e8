"""One decoder call over unpadded tokens for rows that share prompt prefixes (exact).

``shared_prefix_logprobs``' layout without padding in the dense work. The decoder sees one row of
``N = sum_u p_u + sum_s n_s`` tokens: every distinct prefix once (``u = 0..U-1``, ``p_u`` ids),
then every row's suffix (``s = 0..S-1``, ``n_s`` ids), with explicit positions (``0..p_u-1`` for
a prefix, ``p_s..p_s+n_s-1`` for a suffix). The projections, MLPs and norms run on the ``N``
real tokens only; only attention is computed on a padded view, which is cheap beside them.

Attention is the one part that must see the grouping. ``packed_attention`` is registered with
transformers' ``AttentionInterface`` and is switched on for the duration of one call
(``packed_decoder_call``). In each layer it gathers, from the packed queries/keys/values:

- the prefixes, right-padded to ``L = max p_u``: ``[U, H, L, D]``, causal (a real query sees
  only real keys, since the padding is on the right);
- the suffixes, right-padded to ``Ls = max n_s``: queries ``[S, H, Ls, D]`` against the keys of
  their own prefix (``L`` slots, those ``>= p_u`` masked) followed by their own suffix (causal);

runs torch's ``scaled_dot_product_attention`` on both (for a model set to ``sdpa`` or ``eager``,
which compute the same function), and scatters the real rows back to packed order. Pad slots are
gathered from a real token of the same segment, so every value is finite; every query row sees at
least one real key (its prefix has ``p >= 1``), so no softmax row is empty. The gathers are
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
class PackedLayout:
    """Index maps between the packed row and the padded prefix/suffix views (module doc).

    ``pre_idx_U_L`` / ``suf_q_idx_S_Ls``: packed index of each padded prefix / suffix slot;
    ``suf_kv_idx_S_K``: packed index of each key a suffix row attends to (``K = L + Ls``);
    ``suf_mask_S_Ls_K``: which keys each padded suffix query sees (bool; the prefixes are causal);
    ``out_idx_N``: for packed token ``i``, its row in ``cat(prefix out [U*L], suffix out [S*Ls])``.
    """

    pre_idx_U_L: torch.Tensor
    suf_q_idx_S_Ls: torch.Tensor
    suf_kv_idx_S_K: torch.Tensor
    suf_mask_S_Ls_K: torch.Tensor
    out_idx_N: torch.Tensor
    ids_N: torch.Tensor
    positions_N: torch.Tensor
    pre_start_U: torch.Tensor
    suf_start_S: torch.Tensor


def packed_layout(pre_ids_U_L: torch.Tensor, pre_len_U: torch.Tensor, suf_ids_S_Ls: torch.Tensor,
                  suf_len_S: torch.Tensor, inv_S: torch.Tensor) -> PackedLayout:
    """Build the layout from right-padded prefixes/suffixes and ``inv_S`` (row -> its prefix).

    Every ``p_u`` and ``n_s`` must be >= 1.
    """
    device = pre_ids_U_L.device
    u_count, length = pre_ids_U_L.shape
    s_count, s_len = suf_ids_S_Ls.shape
    ar_L = torch.arange(length, device=device)
    ar_Ls = torch.arange(s_len, device=device)
    pre_real_U_L = ar_L[None, :] < pre_len_U[:, None]
    suf_real_S_Ls = ar_Ls[None, :] < suf_len_S[:, None]
    pre_start_U = torch.cumsum(pre_len_U, 0) - pre_len_U
    n_pre = int(pre_len_U.sum())
    suf_start_S = n_pre + torch.cumsum(suf_len_S, 0) - suf_len_S
    pre_idx_U_L = pre_start_U[:, None] + torch.minimum(ar_L[None, :], pre_len_U[:, None] - 1)
    suf_q_idx_S_Ls = suf_start_S[:, None] + torch.minimum(ar_Ls[None, :], suf_len_S[:, None] - 1)
    suf_kv_idx_S_K = torch.cat([pre_idx_U_L.index_select(0, inv_S), suf_q_idx_S_Ls], dim=1)
    causal_Ls_Ls = ar_Ls[:, None] >= ar_Ls[None, :]
    suf_mask_S_Ls_K = torch.cat([pre_real_U_L.index_select(0, inv_S)[:, None, :]
                                 .expand(s_count, s_len, length),
                                 causal_Ls_Ls[None].expand(s_count, s_len, s_len)], dim=2)
    out_idx_N = torch.cat([
        (torch.arange(u_count, device=device)[:, None] * length + ar_L[None, :])[pre_real_U_L],
        (u_count * length + torch.arange(s_count, device=device)[:, None] * s_len
         + ar_Ls[None, :])[suf_real_S_Ls]])
    ids_N = torch.cat([pre_ids_U_L[pre_real_U_L], suf_ids_S_Ls[suf_real_S_Ls]])
    pre_len_S = pre_len_U.index_select(0, inv_S)
    positions_N = torch.cat([ar_L[None, :].expand(u_count, -1)[pre_real_U_L],
                             (pre_len_S[:, None] + ar_Ls[None, :])[suf_real_S_Ls]])
    return PackedLayout(pre_idx_U_L, suf_q_idx_S_Ls, suf_kv_idx_S_K, suf_mask_S_Ls_K, out_idx_N,
                        ids_N, positions_N, pre_start_U, suf_start_S)


def packed_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention over the packed row ``[1, H, N, D]`` -> ``[1, N, H, D]`` (module doc).

    ``kwargs`` carries ``closedloop_layout`` (a ``PackedLayout``). Both padded views go through
    ``torch.nn.functional.scaled_dot_product_attention`` with grouped-query heads left grouped
    (``enable_gqa``: no key/value copy per query head): the prefixes with ``is_causal`` (under
    right padding a real query only sees real keys), the suffixes with their boolean mask.
    """
    layout: PackedLayout = kwargs["closedloop_layout"]
    q_H_N_D, k_H_N_D, v_H_N_D = query[0], key[0], value[0]
    gqa = q_H_N_D.shape[0] != k_H_N_D.shape[0]

    def view(t_H_N_D: torch.Tensor, idx_R_C: torch.Tensor) -> torch.Tensor:
        rows, cols = idx_R_C.shape
        picked = t_H_N_D.index_select(1, idx_R_C.reshape(-1))
        return picked.view(t_H_N_D.shape[0], rows, cols, -1).transpose(0, 1)

    sdpa = torch.nn.functional.scaled_dot_product_attention
    pre_out = sdpa(view(q_H_N_D, layout.pre_idx_U_L), view(k_H_N_D, layout.pre_idx_U_L),
                   view(v_H_N_D, layout.pre_idx_U_L), dropout_p=dropout, is_causal=True,
                   scale=scaling, enable_gqa=gqa)
    suf_out = sdpa(view(q_H_N_D, layout.suf_q_idx_S_Ls), view(k_H_N_D, layout.suf_kv_idx_S_K),
                   view(v_H_N_D, layout.suf_kv_idx_S_K), attn_mask=layout.suf_mask_S_Ls_K[:, None],
                   dropout_p=dropout, scale=scaling, enable_gqa=gqa)
    heads, dim = pre_out.shape[1], pre_out.shape[-1]
    both = torch.cat([pre_out.transpose(1, 2).reshape(-1, heads, dim),
                      suf_out.transpose(1, 2).reshape(-1, heads, dim)])
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
