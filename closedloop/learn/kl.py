"""Sampled-token estimators of KL(πθ || πref) and the record that says how KL is used.

Given log πθ(x) and log πref(x) at tokens x, with Δ = log πθ(x) - log πref(x) and
r = πref(x)/πθ(x) = exp(-Δ):

- ``k1`` = Δ                      unbiased for KL(πθ||πref) when x ~ πθ; can be negative.
- ``k2`` = ½ Δ²                   biased (E[k2] = KL + O(Δ³)); non-negative, low variance.
- ``k3`` = r - log r - 1 = exp(-Δ) + Δ - 1
                                  unbiased when x ~ πθ (E_θ[r] = 1); non-negative (e^u ≥ 1+u).

"Unbiased" holds only when tokens are sampled from πθ itself. Averaging over behaviour samples
(stale, async or replayed data) estimates something else; :class:`KLSpec` records which
distribution produced the tokens so a report can say so.

Gradients, when the estimate is placed in the loss and differentiated with the samples held
fixed (x ~ πθ, expectation over x):

- ∇k1 = ∇log πθ(x)            -> E = 0 (k1 in the loss adds no expected KL gradient);
- ∇k2 = Δ ∇log πθ(x)          -> E = ∇ KL(πθ||πref) (the forward-KL gradient);
- ∇k3 = (1 - r) ∇log πθ(x)    -> E = ∇ KL(πref||πθ) (the *reverse*-KL gradient).

tests/learn/test_kl.py checks these identities exactly on a small categorical.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch

from closedloop.contracts.batch import KL_ESTIMATOR_NAMES, KLSpec
from closedloop.errors import KLPlacementError, LearnError, UnknownNameError

__all__ = [
    "KL_ESTIMATORS",
    "KLPlacementError",
    "exact_kl",
    "get_kl_estimator",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_reward_penalty",
    "validate_kl_placement",
]

KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def kl_k1(logp_theta: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """k1 = log πθ - log πref, elementwise (any shape)."""
    return logp_theta - logp_ref


def kl_k2(logp_theta: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """k2 = ½ (log πθ - log πref)², elementwise (any shape)."""
    return 0.5 * (logp_theta - logp_ref) ** 2


def kl_k3(logp_theta: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """k3 = exp(log πref - log πθ) - (log πref - log πθ) - 1, elementwise; always >= 0.

    ``expm1`` keeps the value accurate (and exactly 0) when the log-probs agree.
    """
    d = logp_ref - logp_theta
    return torch.expm1(d) - d


KL_ESTIMATORS: Mapping[str, KLFn] = MappingProxyType({"k1": kl_k1, "k2": kl_k2, "k3": kl_k3})
assert tuple(KL_ESTIMATORS) == KL_ESTIMATOR_NAMES  # the contract names exactly these
"""Sampled-token KL estimators by name; read-only."""


def get_kl_estimator(name: str) -> KLFn:
    """Return the KL estimator registered as ``name``; raise :class:`UnknownNameError`."""
    try:
        return KL_ESTIMATORS[name]
    except KeyError:
        raise UnknownNameError("KL estimator", name, KL_ESTIMATORS) from None


def exact_kl(logp_theta_V: torch.Tensor, logp_ref_V: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary KL(πθ||πref) = Σ_v πθ(v) (log πθ(v) - log πref(v)) over the last dim.

    Inputs are normalized log-probs [..., V]; output [...]. Use it for audits and as ground
    truth for the sampled estimators. Terms with πθ(v) = 0 contribute 0.
    """
    p = logp_theta_V.exp()
    terms = torch.where(p > 0, p * (logp_theta_V - logp_ref_V), torch.zeros_like(p))
    return terms.sum(dim=-1)


def validate_kl_placement(loss_spec: KLSpec | None, reward_spec: KLSpec | None) -> None:
    """Raise :class:`KLPlacementError` unless KL enters at most one of loss and reward.

    ``loss_spec`` is the spec an objective was given; ``reward_spec`` the spec already applied
    to the rewards behind its advantages (or ``None``). Each must carry its own placement.
    """
    if loss_spec is not None and reward_spec is not None:
        raise KLPlacementError("KL is placed in both the reward and the loss; choose one placement")
    if loss_spec is not None and loss_spec.placement != "loss":
        raise KLPlacementError(
            f"objective got a KLSpec with placement {loss_spec.placement!r}; pass it as "
            "reward_kl_spec (already applied to rewards) or set placement='loss'"
        )
    if reward_spec is not None and reward_spec.placement != "reward":
        raise KLPlacementError(
            f"reward_kl_spec has placement {reward_spec.placement!r}, expected 'reward'"
        )


def kl_reward_penalty(
    logp_theta_B_T: torch.Tensor,
    logp_ref_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    spec: KLSpec,
) -> torch.Tensor:
    """Per-episode reward penalty β · Σ_{t∈M_i} k(t), shape [B], detached.

    Subtract it from the episode reward *before* credit when ``spec.placement == "reward"``;
    the objective must then be told (``reward_kl_spec``) so KL is not also placed in the loss.
    """
    if spec.placement != "reward":
        raise KLPlacementError(
            f"kl_reward_penalty needs placement 'reward', got {spec.placement!r}"
        )
    if logp_theta_B_T.shape != logp_ref_B_T.shape or logp_ref_B_T.shape != mask_B_T.shape:
        raise LearnError("logp_theta_B_T, logp_ref_B_T and mask_B_T must share one [B, T] shape")
    on = mask_B_T > 0
    k = get_kl_estimator(spec.estimator)(logp_theta_B_T.detach(), logp_ref_B_T.detach())
    k = torch.where(on, k, torch.zeros((), dtype=k.dtype))
    return spec.beta * k.sum(dim=1)
