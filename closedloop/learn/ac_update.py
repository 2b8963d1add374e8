"""The actor–critic update of a feature policy, rebuilt from its traces alone.

:func:`turn_batch` reads recorded episodes (``closedloop.contracts.Episode``) into padded
per-turn tensors: boundary k's features are decoded from turn k's ``prompt_token_ids`` (what
the policy read), the action from ``action_token_ids``, π_beh(a_k) from
``behavior_logprobs``; the boundary after the last action (h_K) takes its features from the
recorded last observation. Per-turn rewards are the verifier's outcome on a terminal episode's
last turn plus optional step rewards (potential-based shaping terms); a truncated episode has
no outcome and bootstraps V(h_K); system events are left out (``turn_credit.episode_boundary``).

:func:`ac_loss` unrolls the GRU over the recorded boundaries, computes turn-level GAE with the
current critic (values detached) and returns

    L = -mean_k min(ρ_k Â_k, clip(ρ_k, 1-ε, 1+ε) Â_k) + c_v · mean_k ½ (V(h_k) - R^λ_k)²
        - c_H · mean_k H(π(·|h_k)),       ρ_k = π_θ(a_k|h_k) / π_beh(a_k|h_k),

means over the batch's credited turns, Â the GAE advantages normalized over the batch when
``normalize`` (a surrogate's scale, not its sign).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from closedloop.contracts import Episode
from closedloop.contracts.package import FeatureCodec
from closedloop.errors import LearnError
from closedloop.learn.recurrent_ac import RecurrentActorCritic, action_mask, decode_features
from closedloop.learn.turn_credit import episode_boundary, gae, turn_rewards

__all__ = ["ACConfig", "ACLoss", "TurnBatch", "ac_loss", "turn_batch"]


@dataclass(frozen=True)
class TurnBatch:
    """Padded per-turn tensors of B episodes with K_max credited turns (K_max + 1 boundaries).

    ``features_B_K1_F``/``masks_B_K1_A``/``actions_B_K1`` are per boundary (actions -1 where
    none); ``behavior_logp_B_K``, ``rewards_B_K`` and ``valid_B_K`` per credited turn;
    ``n_turns_B`` and ``bootstrap_B`` per episode; ``episode_ids`` in row order.
    """

    features_B_K1_F: torch.Tensor
    masks_B_K1_A: torch.Tensor
    actions_B_K1: torch.Tensor
    behavior_logp_B_K: torch.Tensor
    rewards_B_K: torch.Tensor
    valid_B_K: torch.Tensor
    n_turns_B: torch.Tensor
    bootstrap_B: torch.Tensor
    episode_ids: tuple[str, ...]


def _rows(episode: Episode, codec: FeatureCodec, step_rewards: Sequence[float] | None
          ) -> tuple[list[list[int]], list[int], list[float], torch.Tensor, bool] | None:
    traj = episode.trajectory
    bound = episode_boundary(traj.termination, len(episode.turns))
    if bound is None or bound.n_turns == 0 or traj.quarantine_reason is not None:
        return None
    turns = episode.turns[:bound.n_turns]
    feats = [decode_features(t.prompt_token_ids, codec.n_features) for t in turns]
    feats.append(list(codec.features(turns[-1].observation)))
    actions = [int(t.action_token_ids[0]) for t in turns]
    beh = [float(t.behavior_logprobs[0]) for t in turns]
    outcome = None if bound.bootstrap else traj.task_success
    if not bound.bootstrap and outcome is None:
        return None  # terminal but unscored: nothing to credit
    rewards = turn_rewards(bound.n_turns, outcome, bound.bootstrap,
                           None if step_rewards is None else step_rewards[:bound.n_turns])
    return feats, actions, beh, rewards, bound.bootstrap


def turn_batch(episodes: Sequence[Episode], codec: FeatureCodec,
               step_rewards: Mapping[str, Sequence[float]] | None = None) -> TurnBatch:
    """The padded tensors of the module docstring; episodes without credit are dropped.

    ``step_rewards[episode_id]`` adds per-turn rewards (one per executed turn), e.g. shaping;
    an episode it does not name gets none.
    """
    rows = []
    ids = []
    for ep in episodes:
        eid = ep.trajectory.episode_id
        row = _rows(ep, codec, None if step_rewards is None else step_rewards.get(eid))
        if row is not None:
            rows.append(row)
            ids.append(eid)
    if not rows:
        raise LearnError("no episode in the batch carries turn credit")
    b, k = len(rows), max(len(r[1]) for r in rows)
    n_act = len(codec.actions)
    features = torch.zeros(b, k + 1, codec.n_features)
    masks = torch.ones(b, k + 1, n_act, dtype=torch.bool)
    actions = torch.full((b, k + 1), -1, dtype=torch.long)
    beh = torch.zeros(b, k)
    rewards = torch.zeros(b, k, dtype=torch.float64)
    valid = torch.zeros(b, k, dtype=torch.bool)
    for i, (feats, acts, lps, r, _) in enumerate(rows):
        n = len(acts)
        features[i, : n + 1] = torch.tensor(feats, dtype=torch.float32)
        masks[i, : n + 1] = torch.tensor([action_mask(codec, f) for f in feats])
        actions[i, :n] = torch.tensor(acts)
        beh[i, :n] = torch.tensor(lps)
        rewards[i, :n] = r
        valid[i, :n] = True
    return TurnBatch(features, masks, actions, beh, rewards, valid,
                     torch.tensor([len(r[1]) for r in rows]),
                     torch.tensor([r[4] for r in rows]), tuple(ids))


@dataclass(frozen=True)
class ACConfig:
    """Hyperparameters of :func:`ac_loss`: discount γ, GAE λ, clip ε, value and entropy
    coefficients, and whether advantages are normalized over the batch."""

    gamma: float = 0.99
    lam: float = 0.95
    clip_eps: float = 0.2
    value_coef: float = 0.5
    entropy_coef: float = 0.01
    normalize: bool = True


@dataclass(frozen=True)
class ACLoss:
    """The loss (with grad) and its parts; ``advantages_B_K``/``returns_B_K`` are the GAE
    outputs (detached, 0 off ``valid``)."""

    loss: torch.Tensor
    policy_loss: float
    value_loss: float
    entropy: float
    ratio_max: float
    advantages_B_K: torch.Tensor
    returns_B_K: torch.Tensor


def _gae_all(batch: TurnBatch, values_B_K1: torch.Tensor, cfg: ACConfig
             ) -> tuple[torch.Tensor, torch.Tensor]:
    adv = torch.zeros_like(batch.rewards_B_K)
    ret = torch.zeros_like(batch.rewards_B_K)
    v = values_B_K1.detach().double()
    for i in range(adv.shape[0]):
        n = int(batch.n_turns_B[i])
        out = gae(batch.rewards_B_K[i, :n], v[i, : n + 1], cfg.gamma, cfg.lam,
                  bool(batch.bootstrap_B[i]))
        adv[i, :n], ret[i, :n] = out.advantages_K, out.returns_K
    return adv, ret


def ac_loss(model: RecurrentActorCritic, batch: TurnBatch, cfg: ACConfig) -> ACLoss:
    """The clipped actor–critic loss of the module docstring on one batch."""
    logp_all, values = model.unroll(batch.features_B_K1_F, batch.actions_B_K1,
                                    batch.masks_B_K1_A)
    adv, ret = _gae_all(batch, values, cfg)
    k = batch.valid_B_K.shape[1]
    valid = batch.valid_B_K
    a = batch.actions_B_K1[:, :k].clamp(min=0)
    logp = logp_all[:, :k].gather(2, a[..., None]).squeeze(-1)
    ratio = torch.exp(torch.where(valid, logp - batch.behavior_logp_B_K, 0.0))
    a_hat = adv.float()
    if cfg.normalize and int(valid.sum()) > 1:
        sel = a_hat[valid]
        a_hat = torch.where(valid, (a_hat - sel.mean()) / (sel.std() + 1e-8), 0.0)
    lo, hi = 1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps
    surrogate = torch.minimum(ratio * a_hat, ratio.clamp(lo, hi) * a_hat)
    n = valid.sum().clamp(min=1)
    policy_loss = -(surrogate * valid).sum() / n
    value_loss = (0.5 * (values[:, :k] - ret.float()) ** 2 * valid).sum() / n
    probs = logp_all[:, :k].exp()
    ent_terms = torch.where(probs > 0, -probs * logp_all[:, :k], 0.0).sum(-1)
    entropy = (ent_terms * valid).sum() / n
    loss = policy_loss + cfg.value_coef * value_loss - cfg.entropy_coef * entropy
    return ACLoss(loss, float(policy_loss.detach()), float(value_loss.detach()),
                  float(entropy.detach()), float(ratio.detach()[valid].max()),
                  adv.detach(), ret.detach())
