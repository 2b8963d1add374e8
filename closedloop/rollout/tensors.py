"""Training tensors straight from traces: no re-rendering, no re-tokenization.

Each episode's sequence is its threaded context plus its last action::

    ids = prompt(0) + action(0) + prompt(1) + action(1) + ... + action(K-1)

Pre-shift tensors (length T, aligned with ``token_ids_B_T``):

- ``action_mask_B_T``: 1 on action tokens the policy sampled (``TurnRecord.action_mask``), else 0;
- ``behavior_logprobs_B_T`` / ``raw_logprobs_B_T``: the recorded log-probs on action tokens, 0
  elsewhere;
- ``turn_ids_B_T``: the turn index on action tokens, -1 elsewhere;
- ``attention_mask_B_T``: 1 on real tokens, 0 on right padding.

The next-token shift happens once, in ``shift_targets``: position ``t`` of a shifted tensor
(length T-1) describes the prediction of token ``t+1`` from tokens ``<= t``; the first token is
never a target. The trainer's log-probs (``logits[:, :-1]`` scored at ``token_ids[:, 1:]``) align
with the shifted tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from closedloop.contracts import Episode
from closedloop.contracts.batch import TrainingBatch
from closedloop.errors import ContractError


@dataclass(frozen=True)
class ShiftedTargets:
    """Tensors aligned with next-token predictions (length T-1)."""

    target_ids_B_T: torch.Tensor
    mask_B_T: torch.Tensor
    behavior_logprobs_B_T: torch.Tensor
    raw_logprobs_B_T: torch.Tensor
    turn_ids_B_T: torch.Tensor


def episode_sequence(episode: Episode) -> tuple[list[int], list[int], list[float], list[float],
                                                list[int]]:
    """Flatten one episode into (ids, mask, behaviour lps, raw lps, turn ids), pre-shift."""
    ids: list[int] = []
    mask: list[int] = []
    beh: list[float] = []
    raw: list[float] = []
    turns: list[int] = []
    for t in episode.turns:
        if len(ids) + len(t.prompt_token_ids) != t.context_len_before:
            raise ContractError(f"episode {episode.trajectory.episode_id} turn {t.turn}: "
                                "threaded context length does not match the record")
        n_prompt = len(t.prompt_token_ids)
        ids.extend(t.prompt_token_ids)
        mask.extend([0] * n_prompt)
        beh.extend([0.0] * n_prompt)
        raw.extend([0.0] * n_prompt)
        turns.extend([-1] * n_prompt)
        ids.extend(t.action_token_ids)
        mask.extend(t.action_mask)
        beh.extend(lp if m else 0.0 for lp, m in zip(t.behavior_logprobs, t.action_mask,
                                                     strict=True))
        raw_lps = t.raw_model_logprobs or [0.0] * len(t.action_token_ids)
        raw.extend(lp if m else 0.0 for lp, m in zip(raw_lps, t.action_mask, strict=True))
        turns.extend(t.turn if m else -1 for m in t.action_mask)
    return ids, mask, beh, raw, turns


def build_training_batch(episodes: Sequence[Episode], pad_id: int = 0) -> TrainingBatch:
    """Pad B episodes on the right into pre-shift tensors (see the module docstring)."""
    if not episodes:
        raise ContractError("cannot build a training batch from zero episodes")
    rows = [episode_sequence(ep) for ep in episodes]
    length = max(len(r[0]) for r in rows)
    b = len(rows)
    ids = torch.full((b, length), pad_id, dtype=torch.long)
    attn = torch.zeros((b, length), dtype=torch.long)
    mask = torch.zeros((b, length), dtype=torch.float32)
    beh = torch.zeros((b, length), dtype=torch.float32)
    raw = torch.zeros((b, length), dtype=torch.float32)
    turns = torch.full((b, length), -1, dtype=torch.long)
    for i, (r_ids, r_mask, r_beh, r_raw, r_turns) in enumerate(rows):
        n = len(r_ids)
        ids[i, :n] = torch.tensor(r_ids, dtype=torch.long)
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(r_mask, dtype=torch.float32)
        beh[i, :n] = torch.tensor(r_beh, dtype=torch.float32)
        raw[i, :n] = torch.tensor(r_raw, dtype=torch.float32)
        turns[i, :n] = torch.tensor(r_turns, dtype=torch.long)
    return TrainingBatch(ids, attn, mask, beh, raw, turns,
                         tuple(ep.trajectory.episode_id for ep in episodes),
                         tuple(ep.trajectory.group_id for ep in episodes))


def shift_targets(batch: TrainingBatch) -> ShiftedTargets:
    """Drop position 0 of every per-token tensor: the one and only next-token shift.

    A mask whose position 0 is live would lose a target here; it cannot be, since every episode
    starts with a prompt, and this raises rather than drop one silently.
    """
    if bool((batch.action_mask_B_T[:, 0] != 0).any()):
        raise ContractError("an action token at position 0 has no context to be predicted from")
    return ShiftedTargets(
        target_ids_B_T=batch.token_ids_B_T[:, 1:],
        mask_B_T=batch.action_mask_B_T[:, 1:],
        behavior_logprobs_B_T=batch.behavior_logprobs_B_T[:, 1:],
        raw_logprobs_B_T=batch.raw_logprobs_B_T[:, 1:],
        turn_ids_B_T=batch.turn_ids_B_T[:, 1:],
    )
