"""The records the update contract exchanges (``closedloop.contracts.update``): the training
batch (padded pre-shift tensors, built from traces by ``closedloop.rollout.tensors``) and the
KL specification (estimated by ``closedloop.learn.kl``).

Tensors are annotated, never imported: this module runs without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from closedloop.errors import KLPlacementError, UnknownNameError

if TYPE_CHECKING:  # annotations only
    import torch

KL_ESTIMATOR_NAMES = ("k1", "k2", "k3")
"""The KL estimators a ``KLSpec`` may name (``closedloop.learn.kl.KL_ESTIMATORS``)."""
KLPlacement = Literal["loss", "reward"]
KLSampling = Literal["behavior", "current"]


@dataclass(frozen=True)
class TrainingBatch:
    """Padded pre-shift tensors for B episodes (right padding)."""

    token_ids_B_T: torch.Tensor
    attention_mask_B_T: torch.Tensor
    action_mask_B_T: torch.Tensor
    behavior_logprobs_B_T: torch.Tensor
    raw_logprobs_B_T: torch.Tensor
    turn_ids_B_T: torch.Tensor
    episode_ids: tuple[str, ...]
    group_ids: tuple[str, ...]



@dataclass(frozen=True)
class KLSpec:
    """How KL(πθ || πref) is estimated and where it enters the update.

    ``estimator``: "k1" | "k2" | "k3". ``beta``: coefficient (>= 0). ``placement``: "loss"
    (β·KL is added to the loss, reduced with the objective's reducer) or "reward" (β·Σ_t k is
    subtracted from the episode reward before credit; see :func:`kl_reward_penalty`).
    ``sampling``: which policy sampled the tokens the estimate averages over — "current" (πθ,
    the estimate is unbiased for k1/k3) or "behavior" (π_beh; unbiased only when π_beh = πθ,
    e.g. the first step of the strict synchronous baseline). ``direction``: only "theta||ref".
    """

    estimator: str = "k3"
    beta: float = 0.0
    placement: KLPlacement = "loss"
    sampling: KLSampling = "behavior"
    direction: str = "theta||ref"

    def __post_init__(self) -> None:
        """Validate every field; a bad placement raises :class:`KLPlacementError`."""
        if self.estimator not in KL_ESTIMATOR_NAMES:
            raise UnknownNameError("KL estimator", self.estimator, KL_ESTIMATOR_NAMES)
        if self.placement not in ("loss", "reward"):
            raise KLPlacementError(
                f"placement must be 'loss' or 'reward' (never both), got {self.placement!r}"
            )
        if self.sampling not in ("behavior", "current"):
            raise KLPlacementError(
                f"sampling must be 'behavior' or 'current', got {self.sampling!r}"
            )
        if self.direction != "theta||ref":
            raise KLPlacementError(
                f"only direction 'theta||ref' is implemented, got {self.direction!r}"
            )
        if not self.beta >= 0.0:
            raise KLPlacementError(f"beta must be >= 0, got {self.beta}")
