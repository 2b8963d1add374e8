"""A small critic over the LLM policy's hidden state at turn boundaries (turn-level credit,
docs/credit.md).

Boundary h_k of an episode is the context the sampler saw before action k; its feature is the
policy's final-layer hidden state at the last token of context(k) (position
``context_len_before(k) - 1`` of the episode's token ids), computed without gradient: the critic
reads the policy, it never moves it. For a bootstrapped episode (the collector's turn limit),
h_K is the context after the last observation: the episode's ids plus the rendered last
observation (the same renderer call the collector makes), passed in as ``final_ids``; a
terminal episode's V(h_K) is 0 by rule and its h_K feature is the last recorded token's.

    V(h) = w₂ᵀ tanh(W₁ x + b₁) + b₂,   x = hidden state (detached)

:func:`fit_values` regresses V on the GAE targets R^λ_k = A_k + V(h_k) with Adam on the cached
features (``epochs`` full-batch steps, mean squared error).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from closedloop.contracts import Episode
from closedloop.engine import matmul_precision
from closedloop.errors import LearnError
from closedloop.learn.turn_credit import episode_boundary
from closedloop.rollout.tensors import episode_sequence

__all__ = ["TurnCritic", "boundary_features", "fit_values"]


class TurnCritic(nn.Module):
    """V(h) over a hidden state (module docstring)."""

    def __init__(self, hidden_size: int, width: int = 64, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.inp = nn.Linear(hidden_size, width)
        self.out = nn.Linear(width, 1)
        with torch.no_grad():
            for layer in (self.inp, self.out):
                bound = 1.0 / layer.in_features ** 0.5
                layer.weight.copy_(torch.empty_like(layer.weight).uniform_(-bound, bound,
                                                                           generator=gen))
                layer.bias.zero_()

    def forward(self, x_N_H: torch.Tensor) -> torch.Tensor:
        """V of N hidden states: [N, H] -> [N]."""
        return self.out(torch.tanh(self.inp(x_N_H))).squeeze(-1)


def _rows(episodes: Sequence[Episode], final_ids: Mapping[str, Sequence[int]]
          ) -> list[tuple[list[int], list[int]]]:
    """(token ids, boundary positions h_0 … h_K) per episode."""
    out = []
    for ep in episodes:
        bound = episode_boundary(ep.trajectory.termination, len(ep.turns))
        if bound is None or bound.n_turns == 0:
            raise LearnError(f"episode {ep.trajectory.episode_id} has no turn credit")
        ids = episode_sequence(ep)[0]
        positions = [t.context_len_before - 1 for t in ep.turns[:bound.n_turns]]
        extra = list(final_ids.get(ep.trajectory.episode_id, ()))
        if bound.bootstrap and bound.n_turns == len(ep.turns) and not extra:
            raise LearnError(f"episode {ep.trajectory.episode_id} bootstraps after its last "
                             "observation: its rendered ids are needed (final_ids)")
        if bound.n_turns < len(ep.turns):  # h_K is context(K), recorded (a cut-off action)
            positions.append(ep.turns[bound.n_turns].context_len_before - 1)
        else:
            ids = ids + extra
            positions.append(len(ids) - 1)
        out.append((ids, positions))
    return out


@torch.no_grad()
def boundary_features(model: nn.Module, episodes: Sequence[Episode], pad_id: int,
                      final_ids: Mapping[str, Sequence[int]] | None = None,
                      micro_batch_size: int = 4, precision: str = "float32"
                      ) -> list[torch.Tensor]:
    """The policy's final-layer hidden state at h_0 … h_K of each episode: [K+1, H] each."""
    rows = _rows(episodes, final_ids or {})
    feats: list[torch.Tensor] = []
    was_training = model.training
    model.eval()
    try:
        with matmul_precision(model, precision):
            for start in range(0, len(rows), micro_batch_size):
                chunk = rows[start:start + micro_batch_size]
                length = max(len(ids) for ids, _ in chunk)
                ids_B_T = torch.full((len(chunk), length), pad_id, dtype=torch.long)
                attn_B_T = torch.zeros((len(chunk), length), dtype=torch.long)
                for i, (ids, _) in enumerate(chunk):
                    ids_B_T[i, : len(ids)] = torch.tensor(ids)
                    attn_B_T[i, : len(ids)] = 1
                out = model(input_ids=ids_B_T, attention_mask=attn_B_T,
                            output_hidden_states=True)
                last = out.hidden_states[-1].float()
                feats += [last[i, pos] for i, (_, pos) in enumerate(chunk)]
    finally:
        model.train(was_training)
    return feats


def fit_values(critic: TurnCritic, optimizer: torch.optim.Optimizer,
               features: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
               epochs: int) -> float:
    """``epochs`` Adam steps of mean squared error between V(h_k) and its target over every
    credited boundary (h_0 … h_{K-1} of each episode); the loss before the first step."""
    x = torch.cat([f[: t.numel()] for f, t in zip(features, targets, strict=True)])
    y = torch.cat([t.float() for t in targets])
    first = float("nan")
    for epoch in range(epochs):
        loss = 0.5 * ((critic(x) - y) ** 2).mean()
        if epoch == 0:
            first = float(loss.detach())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return first
