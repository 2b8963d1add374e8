"""The sampler's distribution, as pure functions (docs/concepts.md, log-prob
consistency audit: tempered scoring).

The behaviour log-prob of a sampled token is its log-probability under the distribution that
*actually* sampled it, not under the raw model. For logits ``z`` (one row of ``logits_B_V``) and a
``SamplerConfig(temperature τ, top_k k, top_p p, greedy)``:

1. temperature: ``s = z / τ``;
2. top-k: keep tokens with ``s_i >= s_(k)`` (the k-th largest value; ties at the threshold are
   kept, so the support may exceed k);
3. top-p (nucleus): sort the kept tokens by probability ``q = softmax(s)`` descending (stable on
   ties: lower id first); keep token ``j`` when the mass strictly before it is ``< p``; the top
   token is always kept;
4. ``logprobs = log_softmax(s masked to -inf outside the support)``: the renormalized
   distribution over the support; tokens outside it are ``-inf``.

Greedy is the point mass on ``argmax z`` (lowest id on ties): log-prob 0 there, ``-inf``
elsewhere. ``sample`` draws by inverting the CDF of ``exp(logprobs)``; a token outside the support
has probability exactly 0, an empty interval of the CDF, and can never be drawn. The raw log-prob
of the same token is ``log_softmax(z)[id]`` (temperature 1, no truncation).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from closedloop.contracts import SamplerConfig

NEG_INF = float("-inf")


class SampleResult(NamedTuple):
    """Sampled ids and both log-probs, each of shape ``[B]``."""

    ids_B: torch.Tensor
    behavior_logprobs_B: torch.Tensor
    raw_logprobs_B: torch.Tensor


def transform_logits(logits_B_V: torch.Tensor, sampler: SamplerConfig) -> torch.Tensor:
    """Return ``logprobs_B_V`` of the sampling distribution (see module doc), in float32 or wider.

    Every row has at least one finite entry; entries outside the support are ``-inf``.
    """
    logits = logits_B_V.float() if logits_B_V.dtype in (torch.float16, torch.bfloat16) \
        else logits_B_V
    if sampler.greedy:
        out = torch.full_like(logits, NEG_INF)
        return out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 0.0)
    scores = logits / sampler.temperature
    if sampler.top_k is not None and sampler.top_k < scores.shape[-1]:
        kth_B_1 = torch.topk(scores, sampler.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth_B_1, NEG_INF)
    if sampler.top_p < 1.0:
        scores = _top_p_mask(scores, sampler.top_p)
    return torch.log_softmax(scores, dim=-1)


def _top_p_mask(scores_B_V: torch.Tensor, top_p: float) -> torch.Tensor:
    probs_B_V = torch.softmax(scores_B_V, dim=-1)
    sorted_B_V, order_B_V = torch.sort(probs_B_V, dim=-1, descending=True, stable=True)
    mass_before_B_V = torch.cumsum(sorted_B_V, dim=-1) - sorted_B_V
    drop_sorted_B_V = mass_before_B_V >= top_p
    drop_sorted_B_V[..., 0] = False
    drop_B_V = torch.zeros_like(drop_sorted_B_V).scatter_(-1, order_B_V, drop_sorted_B_V)
    return scores_B_V.masked_fill(drop_B_V, NEG_INF)


RowGenerators = torch.Generator | Sequence[torch.Generator] | None
"""One generator for the whole batch (``None``: torch's default), or one per row."""


def uniforms(n: int, generator: RowGenerators, device: torch.device | None = None
             ) -> torch.Tensor:
    """``[n, 1]`` float64 draws from U[0, 1): ``n`` from one generator, or one from each of
    ``n`` per-row generators (row ``b``'s draw then depends only on its own generator's state,
    not on which other rows share the batch). Drawn where the generators live and moved to
    ``device``: CPU generators give the same draws for a policy on any device."""
    if generator is None or isinstance(generator, torch.Generator):
        where = generator.device if generator is not None else None
        u = torch.rand((n, 1), generator=generator, dtype=torch.float64, device=where)
        return u if device is None else u.to(device)
    if len(generator) != n:
        raise ValueError(f"{len(generator)} row generators for {n} rows")
    u = torch.cat([torch.rand((1, 1), generator=g, dtype=torch.float64, device=g.device)
                   for g in generator])
    return u if device is None else u.to(device)


def sample(logprobs_B_V: torch.Tensor, generator: RowGenerators = None) -> torch.Tensor:
    """Draw one id per row from ``exp(logprobs_B_V)`` by inverting its CDF; return ``ids_B``.

    ``c_i = sum_{j <= i} exp(logprobs_j - max)`` in float64; with ``u ~ U[0, 1)`` (one float64
    draw per row from ``generator``, or from row ``b``'s own generator: ``uniforms``) and
    ``x = min(u * c_V, c_V^-)`` (``c_V^-``: the float just below the total), the id is the
    first ``i`` with ``c_i > x``. Token ``i`` owns the interval ``[c_{i-1}, c_i)``, of width its
    probability; a ``-inf`` entry adds exactly 0, so its interval is empty and it can never be
    drawn. The running sum is float64 so that a token down to ~1e-16 of its row's mass keeps its
    own interval (a float32 sum would round away every step below ~6e-8 of the total). Two
    distributions inverted at the same ``u`` give different ids only when ``u`` falls between
    their CDFs at some id: with probability at most ``Σ_i |F(i) − G(i)|``, which vanishes as the
    distributions approach each other (the coupling that paired sampling streams rely on).
    """
    lp = logprobs_B_V.float() if logprobs_B_V.dtype in (torch.float16, torch.bfloat16) \
        else logprobs_B_V
    top_B_1 = lp.max(dim=-1, keepdim=True).values
    cdf_B_V = (lp - top_B_1).exp_().to(torch.float64).cumsum_(dim=-1)
    total_B_1 = cdf_B_V[:, -1:]
    u_B_1 = uniforms(lp.shape[0], generator, lp.device)
    x_B_1 = torch.minimum(u_B_1.mul_(total_B_1),
                          torch.nextafter(total_B_1, torch.zeros_like(total_B_1)))
    return torch.searchsorted(cdf_B_V, x_B_1, right=True).squeeze(-1)


def sample_step(logits_B_V: torch.Tensor, sampler: SamplerConfig,
                generator: RowGenerators = None) -> SampleResult:
    """Transform, sample and return ids with behaviour and raw log-probs (all ``[B]``)."""
    logprobs_B_V = transform_logits(logits_B_V, sampler)
    ids_B = logprobs_B_V.argmax(dim=-1) if sampler.greedy else sample(logprobs_B_V, generator)
    behavior_B = logprobs_B_V.gather(-1, ids_B[:, None]).squeeze(-1)
    raw_B = raw_logprobs_at(logits_B_V, ids_B)
    return SampleResult(ids_B, behavior_B, raw_B)


def raw_logprobs_at(logits_B_V: torch.Tensor, ids_B: torch.Tensor) -> torch.Tensor:
    """Return ``log_softmax(logits)[b, ids[b]]`` as ``logits.gather - logsumexp`` (``[B]``)."""
    logits = logits_B_V.float()
    picked_B = logits.gather(-1, ids_B[:, None]).squeeze(-1)
    return picked_B - torch.logsumexp(logits, dim=-1)
