"""Log-probs of realized tokens with each distinct prompt prefix forwarded once (exact).

Same output contract as ``closedloop.engine.logprobs.sequence_logprobs`` (float32 ``[B, T-1]``,
``out[b, t] = log softmax(z / τ)[x[b, t+1]]`` where the target mask is 1, else 0), computed so
that rows sharing a prefix (GRPO siblings: one prompt, G completions) run it through the decoder
once instead of G times. ``prefix_len_B[b] = p`` names the prefix ``x[b, :p]``; rows are
deduplicated by the exact tuple of their prefix ids.

The rows with ``p > 0`` take **one decoder call over unpadded tokens**: every distinct prefix
once, then every row's suffix ``x[b, p:len_b]``, in one packed row with explicit positions, and
an attention that lets each suffix see its own prefix and its own earlier tokens
(``closedloop.engine.packed_prefix``; the decoder's attention must be ``sdpa`` or ``eager``, the
two a CPU model loads with, else ``LogprobInputError``). The dense work (projections, MLPs,
norms) then runs on real tokens only. The hidden state predicting target ``t`` is the prefix's
at ``t`` if ``t < p`` (``t = p - 1`` predicts the first suffix token) else the suffix's at
``t - p``; the vocabulary projection runs at target positions only, in chunks, as
``logit[x] - logsumexp(logits)``.

Rows with ``p = 0`` and at least one target go through ``sequence_logprobs`` (one more decoder
call); rows without targets are all zeros and are not forwarded. A row whose prefix nobody else
shares is still exact (a group of one, same token count). Equal to the unshared path up to
floating-point summation order (attention over gathered keys, the gradient summed over
siblings). With dropout > 0 the siblings share one dropout mask on the prefix.
"""

from __future__ import annotations

from typing import Any

import torch

from closedloop.engine.device import to_model_device
from closedloop.engine.logprobs import _decoder_and_head, checked_targets, sequence_logprobs
from closedloop.engine.packed_prefix import packed_decoder_call, packed_layout, packs
from closedloop.engine.vocab_scoring import target_logprobs
from closedloop.errors import LogprobInputError


def prompt_prefix_lengths(target_mask_B_T: torch.Tensor) -> torch.Tensor:
    """Return ``prefix_len_B``: the number of ids before each row's first action token.

    ``target_mask_B_T`` is shifted (``[B, T-1]``, position ``t`` predicts token ``t+1``), so the
    first target at ``t0`` gives ``p = t0 + 1`` (the prompt ``x[:t0+1]``; the action token
    ``x[t0+1]`` is the first suffix token). Rows without a target get 0.
    """
    live_B_T = target_mask_B_T.bool()
    first_B = live_B_T.long().argmax(dim=1)
    return torch.where(live_B_T.any(dim=1), first_B + 1, torch.zeros_like(first_B))


def common_prefix_lengths(token_ids_B_T: torch.Tensor, attention_mask_B_T: torch.Tensor,
                          target_mask_B_T: torch.Tensor) -> torch.Tensor:
    """Return ``prefix_len_B``, every entry the same ``p``: the longest prefix all rows share,
    cut at the earliest row's first target (``prompt_prefix_lengths``), so the shared ids are
    prompt only.

    Rows of different prompts built on one scaffold share its system message: with this prefix
    ``shared_prefix_logprobs`` forwards it once per call instead of once per row (supervised
    batches, whose rows are different tasks). Rows without targets do not constrain ``p`` and get
    0 (they are not scored); when no row has a target, or nothing is shared, every entry is 0
    (the unshared path).
    """
    first_B = prompt_prefix_lengths(target_mask_B_T)
    live = [b for b in range(token_ids_B_T.shape[0]) if int(first_B[b]) > 0]
    if not live:
        return torch.zeros_like(first_B)
    ids_R_T = token_ids_B_T[live]
    limit = min(int(first_B[b]) for b in live)
    same_T = (ids_R_T[:, :limit] == ids_R_T[:1, :limit]).all(dim=0)
    same_T &= attention_mask_B_T[live][:, :limit].bool().all(dim=0)
    p = limit if bool(same_T.all()) else int((~same_T).long().argmax())
    out_B = torch.zeros_like(first_B)
    out_B[live] = p
    return out_B


def shared_prefix_logprobs(model: Any, token_ids_B_T: torch.Tensor,
                           attention_mask_B_T: torch.Tensor | None = None,
                           target_mask_B_T: torch.Tensor | None = None,
                           prefix_len_B: torch.Tensor | None = None,
                           chunk_size: int = 1024, temperature: float = 1.0) -> torch.Tensor:
    """Return float32 ``logprobs`` ``[B, T-1]``, equal to ``sequence_logprobs`` (module doc).

    ``prefix_len_B`` defaults to ``prompt_prefix_lengths`` of the target mask. Each ``p > 0``
    must leave at least one real token after it (``p <= len_b - 1``), and its row must be
    right-padded; a violation raises ``LogprobInputError``. Computed on the model's device,
    returned on the ids' (``closedloop.engine.device``).
    """
    home = token_ids_B_T.device
    ids, attention_mask_B_T, target_mask_B_T, prefix_len_B = to_model_device(
        model, token_ids_B_T, attention_mask_B_T, target_mask_B_T, prefix_len_B)
    assert ids is not None
    mask, sel_B_Tm1 = checked_targets(ids, attention_mask_B_T, target_mask_B_T)
    p_B = (prompt_prefix_lengths(sel_B_Tm1) if prefix_len_B is None
           else prefix_len_B.long().to(ids.device))
    _check_prefixes(p_B, mask)
    live_B = sel_B_Tm1.any(dim=1)
    out_B_Tm1 = torch.zeros(sel_B_Tm1.shape, dtype=torch.float32, device=ids.device)
    plain_R = torch.nonzero(live_B & (p_B == 0)).squeeze(1)
    if plain_R.numel():
        lp = sequence_logprobs(model, ids[plain_R], mask[plain_R], sel_B_Tm1[plain_R],
                               chunk_size=chunk_size, temperature=temperature)
        out_B_Tm1 = out_B_Tm1.index_copy(0, plain_R, lp)
    shared_S = torch.nonzero(live_B & (p_B > 0)).squeeze(1)
    if shared_S.numel():
        lp = _shared_rows(model, ids[shared_S], mask[shared_S], sel_B_Tm1[shared_S],
                          p_B[shared_S], chunk_size, temperature)
        out_B_Tm1 = out_B_Tm1.index_copy(0, shared_S, lp)
    return out_B_Tm1.to(home)


def _check_prefixes(p_B: torch.Tensor, mask_B_T: torch.Tensor) -> None:
    """Raise unless ``0 <= p <= len - 1`` for every ``p > 0`` and those rows are right-padded."""
    if p_B.shape != mask_B_T.shape[:1]:
        raise LogprobInputError(f"prefix_len_B must be [B] = [{mask_B_T.shape[0]}], "
                                f"got {tuple(p_B.shape)}")
    len_B = mask_B_T.sum(dim=1)
    has_p = p_B > 0
    if bool((p_B < 0).any()) or bool((has_p & (p_B > len_B - 1)).any()):
        raise LogprobInputError("a prefix must leave at least one real token in its row")
    if bool((has_p & (mask_B_T[:, 0] == 0)).any()):
        raise LogprobInputError("rows with a shared prefix must be right-padded")


def _shared_rows(model: Any, ids_S_T: torch.Tensor, mask_S_T: torch.Tensor,
                 sel_S_Tm1: torch.Tensor, p_S: torch.Tensor, chunk_size: int,
                 temperature: float = 1.0) -> torch.Tensor:
    """Log-probs ``[S, T-1]`` of right-padded rows whose prefixes ``p_S`` are all >= 1."""
    decoder, head = _decoder_and_head(model)
    pre_ids_U_L, pre_len_U, inv_S = _unique_prefixes(ids_S_T, p_S)
    if not packs(decoder):
        attention = getattr(decoder.config, "_attn_implementation", None)
        raise LogprobInputError(f"shared-prefix scoring needs sdpa or eager attention, got "
                                f"{attention!r} (score with share_prompt_prefix=False)")
    tgt_N = ids_S_T[:, 1:][sel_S_Tm1]
    out_S_Tm1 = torch.zeros(sel_S_Tm1.shape, dtype=torch.float32, device=ids_S_T.device)
    suf_ids_S_Ls, suf_mask_S_Ls = _suffixes(ids_S_T, mask_S_T, p_S)
    layout = packed_layout(pre_ids_U_L, pre_len_U, suf_ids_S_Ls, suf_mask_S_Ls.sum(1), inv_S)
    hidden_N_H = _target_rows(packed_decoder_call(decoder, layout), layout.pre_start_U,
                              layout.suf_start_S, sel_S_Tm1, p_S, inv_S)
    lp_N = target_logprobs(head, hidden_N_H, tgt_N, chunk_size, temperature=temperature)
    return out_S_Tm1.masked_scatter(sel_S_Tm1, lp_N)


def _unique_prefixes(ids_S_T: torch.Tensor, p_S: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (distinct prefixes right-padded with 0 ``[U, L]``, their lengths ``[U]``, ``inv_S``).

    ``inv_S[s]`` is the index of row ``s``'s prefix; prefixes are in order of first appearance.
    """
    lens = p_S.tolist()
    rows = ids_S_T[:, :max(lens)].tolist()
    index: dict[tuple[int, ...], int] = {}
    inv = [index.setdefault(tuple(r[:n]), len(index)) for r, n in zip(rows, lens, strict=True)]
    keys = list(index)
    pre_ids_U_L = torch.zeros((len(keys), max(lens)), dtype=ids_S_T.dtype)
    for u, key in enumerate(keys):
        pre_ids_U_L[u, :len(key)] = torch.tensor(key, dtype=ids_S_T.dtype)
    device = ids_S_T.device
    return (pre_ids_U_L.to(device), torch.tensor([len(k) for k in keys], device=device),
            torch.tensor(inv, dtype=torch.long, device=device))


def _suffixes(ids_S_T: torch.Tensor, mask_S_T: torch.Tensor, p_S: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Return each row's ids after its prefix, right-padded with 0, and their mask ``[S, Ls]``."""
    n_S = mask_S_T.sum(dim=1) - p_S
    width = int(n_S.max())
    ar_Ls = torch.arange(width, device=ids_S_T.device)
    src_S_Ls = (p_S[:, None] + ar_Ls[None, :]).clamp(max=ids_S_T.shape[1] - 1)
    suf_mask_S_Ls = (ar_Ls[None, :] < n_S[:, None]).long()
    return ids_S_T.gather(1, src_S_Ls) * suf_mask_S_Ls, suf_mask_S_Ls


def _target_rows(hidden_R_H: torch.Tensor, pre_start_U: torch.Tensor, suf_start_S: torch.Tensor,
                 sel_S_Tm1: torch.Tensor, p_S: torch.Tensor, inv_S: torch.Tensor) -> torch.Tensor:
    """Return the hidden states ``[N, H]`` predicting the targets, in ``sel`` row-major order.

    ``hidden_R_H`` (the packed row) holds every prefix's positions from row ``pre_start_U[u]``
    on and every suffix's from row ``suf_start_S[s]`` on. Target ``(s, t)`` reads prefix
    ``inv_S[s]`` at ``t`` when ``t < p_S[s]``, else suffix ``s`` at ``t - p_S[s]``.
    """
    s_N, t_N = torch.nonzero(sel_S_Tm1, as_tuple=True)
    p_N = p_S[s_N]
    flat_N = torch.where(t_N < p_N, pre_start_U[inv_S[s_N]] + t_N,
                         suf_start_S[s_N] + (t_N - p_N))
    return hidden_R_H.index_select(0, flat_N)


def trainer_path_logprobs(model: Any, token_ids_B_T: torch.Tensor,
                          attention_mask_B_T: torch.Tensor, target_mask_B_T: torch.Tensor,
                          share_prompt_prefix: bool = True,
                          temperature: float = 1.0) -> torch.Tensor:
    """The trainer path's log-probs ``[B, T-1]``: what ``Trainer`` scores and the auditor checks.

    ``temperature`` is the sampler's: the scored distribution is ``softmax(logits / τ)``, the one
    that drew the tokens (docs/concepts.md, log-prob consistency audit: tempered scoring), so a
    fresh on-policy ratio is 1.

    ``share_prompt_prefix`` forwards each distinct prompt (the ids before a row's first action
    token) once with ``shared_prefix_logprobs``; otherwise every row goes through
    ``sequence_logprobs``. Both give the same values up to fp32 summation order.
    """
    if not share_prompt_prefix:
        return sequence_logprobs(model, token_ids_B_T, attention_mask_B_T,
                                 target_mask_B_T=target_mask_B_T, temperature=temperature)
    return shared_prefix_logprobs(model, token_ids_B_T, attention_mask_B_T,
                                  target_mask_B_T=target_mask_B_T,
                                  prefix_len_B=prompt_prefix_lengths(target_mask_B_T),
                                  temperature=temperature)
