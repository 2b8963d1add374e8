"""Trainer-path log-probs of realized tokens: the model side of the single next-token shift.

Convention (the shifted one of ``closedloop.rollout.tensors.shift_targets``): for ids ``x_B_T``
with attention mask ``m_B_T`` the output has length ``T - 1`` and

    logprobs_B_T[b, t] = log π(x[b, t+1] | x[b, <=t])   where ``target_mask[b, t]`` is 1,
    logprobs_B_T[b, t] = 0                               elsewhere,

i.e. ``logits[:, :-1]`` scored at ``token_ids[:, 1:]``: it aligns with ``ShiftedTargets``
(``target_ids_B_T = token_ids[:, 1:]``, ``mask_B_T = action_mask[:, 1:]``). ``target_mask``
(shape ``[B, T-1]``) defaults to ``m[:, :-1] & m[:, 1:]``; passing the shifted action mask
computes only the action positions. Real tokens must be contiguous in each row (left or right
padding); positions are ``cumsum(m) - 1``, as in the generator.

Memory: the vocabulary projection runs only at the ``N`` target positions, in chunks of
``chunk_size`` rows, as ``logit[x] - logsumexp(logits)`` (``closedloop.engine.vocab_scoring``:
vocabulary slices kept in the heap, an in-place backward): no ``[B, T, V]`` log-softmax and no
``[B, T, V]`` logits. Gradients flow (call under ``torch.no_grad()`` to score without them).
"""

from __future__ import annotations

from typing import Any

import torch

from closedloop.engine.device import to_model_device
from closedloop.engine.vocab_scoring import target_logprobs
from closedloop.errors import LogprobInputError


def sequence_logprobs(model: Any, token_ids_B_T: torch.Tensor,
                      attention_mask_B_T: torch.Tensor | None = None,
                      target_mask_B_T: torch.Tensor | None = None,
                      chunk_size: int = 1024, temperature: float = 1.0) -> torch.Tensor:
    """Return float32 ``logprobs`` of shape ``[B, T-1]`` (module doc for the convention), of
    ``softmax(logits / temperature)`` (the sampler's temperature; 1 scores the raw model),
    computed on the model's device and returned on the ids' (``closedloop.engine.device``)."""
    home = token_ids_B_T.device
    ids, attention_mask_B_T, target_mask_B_T = to_model_device(
        model, token_ids_B_T, attention_mask_B_T, target_mask_B_T)
    assert ids is not None
    mask, sel_B_Tm1 = checked_targets(ids, attention_mask_B_T, target_mask_B_T)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    decoder, head = _decoder_and_head(model)
    hidden_B_T_H = decoder(input_ids=ids, attention_mask=mask, position_ids=positions,
                           use_cache=False).last_hidden_state
    hidden_N_H = hidden_B_T_H[:, :-1][sel_B_Tm1]
    lp_N = target_logprobs(head, hidden_N_H, ids[:, 1:][sel_B_Tm1], chunk_size,
                           temperature=temperature)
    out_B_Tm1 = torch.zeros(sel_B_Tm1.shape, dtype=torch.float32, device=ids.device)
    return out_B_Tm1.masked_scatter(sel_B_Tm1, lp_N).to(home)


def checked_targets(ids_B_T: torch.Tensor, attention_mask_B_T: torch.Tensor | None,
                    target_mask_B_T: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate the inputs; return (attention mask ``[B, T]`` as long, scored positions
    ``[B, T-1]`` as bool: both neighbours real, and in ``target_mask`` when given)."""
    mask = torch.ones_like(ids_B_T) if attention_mask_B_T is None else attention_mask_B_T.long()
    if ids_B_T.dim() != 2 or mask.shape != ids_B_T.shape or ids_B_T.shape[1] < 2:
        raise LogprobInputError(f"ids {tuple(ids_B_T.shape)} and mask {tuple(mask.shape)} must "
                                "be equal [B, T] shapes with T >= 2")
    _check_contiguous(mask)
    sel_B_Tm1 = mask[:, :-1].bool() & mask[:, 1:].bool()
    if target_mask_B_T is not None:
        if target_mask_B_T.shape != sel_B_Tm1.shape:
            raise LogprobInputError(f"target mask must be [B, T-1] = {tuple(sel_B_Tm1.shape)}")
        sel_B_Tm1 = sel_B_Tm1 & target_mask_B_T.bool()
    return mask, sel_B_Tm1


def _check_contiguous(mask_B_T: torch.Tensor) -> None:
    """Raise unless each row's ones form one block (left or right padding, not mid-padding)."""
    rises = (mask_B_T[:, 1:] > mask_B_T[:, :-1]).sum(-1) + mask_B_T[:, 0]
    if bool((rises > 1).any()):
        raise LogprobInputError("each row's real tokens must be contiguous (left or right pad)")


def _decoder_and_head(model: Any) -> tuple[Any, Any]:
    """Return (decoder returning ``last_hidden_state``, vocabulary projection) of a causal LM.

    Unwraps a peft ``PeftModel`` (its LoRA layers are injected into the base model's modules).
    """
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if decoder is None or head is None:
        raise LogprobInputError(f"{type(lm).__name__} exposes no decoder/lm_head pair")
    return decoder, head
