"""Credit estimators: trajectory advantages from sibling-group rewards (docs/concepts.md,
group-relative credit).

Every estimator here is a pure function of one group's rewards. A *group* is G sibling
trajectories that share task, base snapshot, behaviour manifest and sampler (the group lease);
normalizing across unrelated tasks would mix task difficulty into action quality, so these
functions take one group at a time.

Shape letters: G group members, K turns.

Formulas (R_i is member i's scalar reward):

- ``rloo``:    A_i = R_i - (1/(G-1)) Σ_{j≠i} R_j                 (= G/(G-1) · (R_i - mean R))
- ``grpo``:    A_i = (R_i - mean R) / (std R + eps), std the population std (divide by G)
- ``dr_grpo``: A_i = R_i - mean R                                (no std, no length division)

Censored members (truncation, timeout, infra abort, scheduler cancel) are never scored 0.
:func:`group_advantages` applies a declared censoring rule and reports what it discarded.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, NamedTuple

import torch

from closedloop.errors import (
    GroupTooSmallError,
    LearnError,
    NonFiniteRewardError,
    UnknownNameError,
)

__all__ = [
    "CENSOR_RULES",
    "ESTIMATORS",
    "CreditSummary",
    "GroupCredit",
    "GroupTooSmallError",
    "LearnError",
    "NonFiniteRewardError",
    "UnknownNameError",
    "dr_grpo",
    "get_estimator",
    "group_advantages",
    "grpo",
    "p_informative",
    "p_zero_variance",
    "returns_to_go",
    "rloo",
    "summarize_credit",
]

RewardsLike = torch.Tensor | Sequence[float]
CensorRule = Literal["discard_group", "drop_censored"]


# ----------------------------------------------------------------------------- helpers
def _as_float_tensor(values: RewardsLike, name: str) -> torch.Tensor:
    """Return ``values`` as a 1-D floating tensor (sequences use torch's default dtype)."""
    if isinstance(values, torch.Tensor):
        out = values if values.is_floating_point() else values.to(torch.get_default_dtype())
    else:
        out = torch.as_tensor(list(values), dtype=torch.get_default_dtype())
    if out.dim() != 1:
        raise LearnError(f"{name} must be 1-D, got shape {tuple(out.shape)}")
    if not bool(torch.isfinite(out).all()):
        raise NonFiniteRewardError(f"{name} holds a non-finite value: {out.tolist()}")
    return out


def _require_group(rewards_G: torch.Tensor, estimator: str) -> None:
    if rewards_G.numel() < 2:
        raise GroupTooSmallError(
            f"{estimator} needs G >= 2 members with a reward, got G={rewards_G.numel()}"
        )


# ----------------------------------------------------------------------------- estimators
def rloo(rewards_G: RewardsLike) -> torch.Tensor:
    """Leave-one-out advantages: A_i = R_i - (1/(G-1)) Σ_{j≠i} R_j.

    Shapes: ``rewards_G`` [G] -> [G]. Raises :class:`GroupTooSmallError` when G < 2.
    Hand-worked: R = [1, 0, 0, 1] gives A = [2/3, -2/3, -2/3, 2/3]. The advantages sum to 0.
    """
    r = _as_float_tensor(rewards_G, "rewards_G")
    _require_group(r, "rloo")
    g = r.numel()
    return r - (r.sum() - r) / (g - 1)


def grpo(rewards_G: RewardsLike, eps: float = 1e-6) -> torch.Tensor:
    """Group-normalized advantages: A_i = (R_i - mean R) / (std R + eps).

    ``std`` is the population standard deviation (divide by G). Dividing by it reweights task
    groups by their within-group reward scale; it is part of the objective, not a numerical
    detail (docs/concepts.md, group-relative credit). A zero-variance group yields all-zero
    advantages.
    Shapes: ``rewards_G`` [G] -> [G]. Raises :class:`GroupTooSmallError` when G < 2.
    Hand-worked: R = [1, .5, .5, 0]: mean .5, std sqrt(.125) = .35355, A ≈ [1.414, 0, 0, -1.414].
    """
    r = _as_float_tensor(rewards_G, "rewards_G")
    _require_group(r, "grpo")
    centered = r - r.mean()
    return centered / (r.std(correction=0) + eps)


def dr_grpo(rewards_G: RewardsLike) -> torch.Tensor:
    """Dr.GRPO advantages: A_i = R_i - mean R (no std division).

    Shapes: ``rewards_G`` [G] -> [G]. Raises :class:`GroupTooSmallError` when G < 2.
    Equals ``(G-1)/G · rloo(R)``. Pair it with a reducer that has no length-dependent divisor
    (``episode_sum``) to remove both biases Dr.GRPO targets.
    """
    r = _as_float_tensor(rewards_G, "rewards_G")
    _require_group(r, "dr_grpo")
    return r - r.mean()


def returns_to_go(rewards_K: RewardsLike, gamma: float) -> torch.Tensor:
    """Discounted turn returns: G_k = r_k + γ G_{k+1}, with G_{K-1} = r_{K-1}.

    ``rewards_K[k]`` is the reward received after turn k. Shapes: [K] -> [K]; K = 0 gives an
    empty tensor. Hand-worked: r = [.2, 0, .5], γ = .8 -> G = [.52, .4, .5].
    """
    if not 0.0 <= gamma <= 1.0:
        raise LearnError(f"gamma must lie in [0, 1], got {gamma}")
    r = _as_float_tensor(rewards_K, "rewards_K")
    out = torch.empty_like(r)
    running = r.new_zeros(())
    for k in range(r.numel() - 1, -1, -1):
        running = r[k] + gamma * running
        out[k] = running
    return out


def p_zero_variance(p: float, G: int) -> float:
    """Probability that a Bernoulli(p) group of G independent members is degenerate.

    P_deg = p^G + (1-p)^G: all successes or all failures, hence no group-relative signal.
    """
    if not 0.0 <= p <= 1.0:
        raise LearnError(f"p must lie in [0, 1], got {p}")
    if G < 1:
        raise LearnError(f"G must be >= 1, got {G}")
    return p**G + (1.0 - p) ** G


def p_informative(p: float, G: int) -> float:
    """Probability that a Bernoulli(p) group holds both a success and a failure.

    P_info = 1 - p^G - (1-p)^G. Hand-worked: p = 0.01, G = 8 -> 0.0773 (1 group in ~12.9).
    """
    return 1.0 - p_zero_variance(p, G)


ESTIMATORS: Mapping[str, Callable[[RewardsLike], torch.Tensor]] = MappingProxyType(
    {"rloo": rloo, "grpo": grpo, "dr_grpo": dr_grpo}
)
"""Credit estimators by name; read-only."""

CENSOR_RULES: tuple[str, ...] = ("discard_group", "drop_censored")
"""Declared censoring rules accepted by :func:`group_advantages`."""


def get_estimator(name: str) -> Callable[[RewardsLike], torch.Tensor]:
    """Return the estimator registered as ``name``; raise :class:`UnknownNameError` otherwise."""
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise UnknownNameError("credit estimator", name, ESTIMATORS) from None


# ----------------------------------------------------------------------------- groups
class GroupCredit(NamedTuple):
    """The credit one group produced, or why it produced none.

    ``advantages`` is aligned with ``member_indices`` (indices into the original group), so a
    censored member simply has no advantage. It is ``None`` when the group is discarded.
    """

    advantages: torch.Tensor | None
    member_indices: tuple[int, ...]
    zero_variance: bool
    discarded: bool
    discard_reason: str | None
    n_members: int
    n_censored: int
    estimator: str
    censor_rule: str


def _censor_mask(
    rewards: Sequence[float | None] | torch.Tensor, censored_G: Sequence[bool] | torch.Tensor | None
) -> list[bool]:
    n = len(rewards)
    if censored_G is None:
        return [False] * n
    mask = [bool(c) for c in censored_G]
    if len(mask) != n:
        raise LearnError(f"censored_G has {len(mask)} entries for {n} rewards")
    return mask


def group_advantages(
    rewards_G: Sequence[float | None] | torch.Tensor,
    estimator: str = "rloo",
    censored_G: Sequence[bool] | torch.Tensor | None = None,
    censor_rule: CensorRule = "discard_group",
) -> GroupCredit:
    """Apply a credit estimator to one group under a declared censoring rule.

    A censored member's reward is ignored (it may be ``None`` or NaN); an uncensored member's
    reward must be finite. Rules:

    - ``discard_group`` (default): any censored member discards the whole group
      (reason ``"censored_member"``); no member gets an advantage.
    - ``drop_censored``: the estimator runs over the uncensored members only; fewer than two
      of them discards the group (reason ``"too_few_uncensored"``).

    A group whose scored rewards are all equal is kept with all-zero advantages and flagged
    ``zero_variance``; count those with :func:`summarize_credit` rather than hiding them.
    """
    fn = get_estimator(estimator)
    if censor_rule not in CENSOR_RULES:
        raise UnknownNameError("censor rule", censor_rule, CENSOR_RULES)
    values = rewards_G.tolist() if isinstance(rewards_G, torch.Tensor) else list(rewards_G)
    censored = _censor_mask(values, censored_G)
    kept = tuple(i for i, c in enumerate(censored) if not c)
    n_censored = len(values) - len(kept)

    def result(adv: torch.Tensor | None, reason: str | None, zero_var: bool) -> GroupCredit:
        return GroupCredit(
            advantages=adv,
            member_indices=kept if adv is not None else (),
            zero_variance=zero_var,
            discarded=adv is None,
            discard_reason=reason,
            n_members=len(values),
            n_censored=n_censored,
            estimator=estimator,
            censor_rule=censor_rule,
        )

    if n_censored and censor_rule == "discard_group":
        return result(None, "censored_member", False)
    if len(kept) < 2:
        return result(None, "too_few_uncensored", False)
    scored = [values[i] for i in kept]
    if any(v is None or not math.isfinite(v) for v in scored):
        raise NonFiniteRewardError(f"uncensored member has reward None or non-finite: {scored}")
    rewards = _as_float_tensor(torch.as_tensor(scored, dtype=_dtype_of(rewards_G)), "rewards_G")
    zero_var = bool((rewards == rewards[0]).all())
    return result(fn(rewards), None, zero_var)


def _dtype_of(rewards: Sequence[float | None] | torch.Tensor) -> torch.dtype:
    if isinstance(rewards, torch.Tensor) and rewards.is_floating_point():
        return rewards.dtype
    return torch.get_default_dtype()


@dataclass(frozen=True)
class CreditSummary:
    """Counts over many groups: zero-variance and discarded groups are reported, not hidden.

    ``zero_variance_rate`` is over groups that produced advantages; ``discard_rate`` is over
    all groups. Both are ``None`` when their denominator is 0.
    """

    n_groups: int
    n_scored_groups: int
    n_zero_variance: int
    n_discarded: int
    discard_reasons: Mapping[str, int] = field(default_factory=dict)
    n_members: int = 0
    n_members_scored: int = 0
    n_members_censored: int = 0

    @property
    def zero_variance_rate(self) -> float | None:
        """Share of scored groups whose advantages are all zero."""
        return self.n_zero_variance / self.n_scored_groups if self.n_scored_groups else None

    @property
    def discard_rate(self) -> float | None:
        """Share of all groups that produced no advantages."""
        return self.n_discarded / self.n_groups if self.n_groups else None


def summarize_credit(groups: Iterable[GroupCredit]) -> CreditSummary:
    """Count scored, zero-variance and discarded groups (with reasons) and member totals."""
    groups = list(groups)
    reasons = Counter(g.discard_reason for g in groups if g.discarded and g.discard_reason)
    scored = [g for g in groups if not g.discarded]
    return CreditSummary(
        n_groups=len(groups),
        n_scored_groups=len(scored),
        n_zero_variance=sum(g.zero_variance for g in scored),
        n_discarded=len(groups) - len(scored),
        discard_reasons=MappingProxyType(dict(reasons)),
        n_members=sum(g.n_members for g in groups),
        n_members_scored=sum(len(g.member_indices) for g in scored),
        n_members_censored=sum(g.n_censored for g in groups),
    )
