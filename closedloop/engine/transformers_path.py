"""The plain transformers path: what the engine's fast paths compute, written the obvious way.

Scoring: for ids ``x_B_T`` with attention mask ``m_B_T`` (real tokens contiguous in each row),

    z = model(input_ids=x, attention_mask=m, position_ids=cumsum(m) - 1).logits    [B, T, V]
    out[b, t] = log_softmax(z[b, t] / τ)[x[b, t+1]]   where m[b, t] = m[b, t+1] = 1 (and the
                                                      target mask, if given, is 1), else 0,

the convention of ``sequence_logprobs`` (``[B, T-1]``, float32; ``τ`` the sampler's temperature).
It materializes ``[B, T, V]`` logits and their log-softmax: fine for tests, too big for training.

Generation: one action from one context, re-running the whole context through
``model(...).logits`` at every step (no KV cache, no decode copy), sampling the last position
with ``closedloop.policy.sampling.sample_step`` and stopping with a ``StopMatcher``, the
``HFGenerator`` rules. Given the same ``torch.Generator`` state it draws the same uniforms as a
one-session ``HFGenerator.generate_batch``, so their ids agree wherever no sampled uniform falls
within rounding of a CDF boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from closedloop.contracts import SamplerConfig
from closedloop.policy.generator import Generation, StopMatcher
from closedloop.policy.sampling import sample_step


def reference_logprobs(model: Any, token_ids_B_T: torch.Tensor,
                       attention_mask_B_T: torch.Tensor | None = None,
                       target_mask_B_T: torch.Tensor | None = None,
                       temperature: float = 1.0) -> torch.Tensor:
    """Return float32 ``[B, T-1]`` log-probs of the realized next tokens (module doc)."""
    ids = token_ids_B_T
    mask = torch.ones_like(ids) if attention_mask_B_T is None else attention_mask_B_T.long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits_B_T_V = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    logp_B_T_V = torch.log_softmax(logits_B_T_V[:, :-1].float() / temperature, dim=-1)
    lp_B_Tm1 = logp_B_T_V.gather(-1, ids[:, 1:, None]).squeeze(-1)
    sel_B_Tm1 = mask[:, :-1].bool() & mask[:, 1:].bool()
    if target_mask_B_T is not None:
        sel_B_Tm1 = sel_B_Tm1 & target_mask_B_T.bool()
    return torch.where(sel_B_Tm1, lp_B_Tm1, torch.zeros_like(lp_B_Tm1))


@torch.no_grad()
def reference_generate(model: Any, context_token_ids: Sequence[int], sampler: SamplerConfig,
                       max_new_tokens: int, generator: torch.Generator,
                       matcher: StopMatcher) -> Generation:
    """Sample one action continuing ``context_token_ids`` (module doc)."""
    ids = [int(i) for i in context_token_ids]
    action: list[int] = []
    behavior: list[float] = []
    raw: list[float] = []
    finish = None
    while finish is None and len(action) < max_new_tokens:
        logits_1_V = model(input_ids=torch.tensor([ids + action])).logits[:, -1].float()
        step = sample_step(logits_1_V, sampler, generator)
        action.append(int(step.ids_B[0]))
        behavior.append(float(step.behavior_logprobs_B[0]))
        raw.append(float(step.raw_logprobs_B[0]))
        finish = matcher.check(action)
    return Generation(action, behavior, raw, finish or "length")
