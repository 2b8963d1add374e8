"""Supervised warm start on demonstrations (docs/concepts.md, warm start: the embedded model
emits no tool calls out of the box, so a small tool-call and recovery SFT stage comes first).

The demonstrations are ordinary traced episodes (the noisy expert's, through the same collector,
renderer and threading), so SFT teacher-forces exactly the ids an RL batch would: the loss is the
token mean of -log πθ over action tokens only (``action_mask``; prompts and observations never
train). Every optimizer step's trained-token count is summed so an SFT-only control can be
matched to an RL arm's token budget later.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from closedloop.contracts import Episode
from closedloop.engine import common_prefix_lengths, matmul_precision, shared_prefix_logprobs
from closedloop.errors import LearnError
from closedloop.rollout.tensors import build_training_batch, shift_targets

SFT_MICRO_BATCH = 4
"""Episodes per backward pass of the warm start. The gradient is the whole batch's whatever
this is (``sft_backward``); it sets the activation memory and the speed: four of the smoke's
800-920-id demonstrations a pass trained faster than eight at two thirds of the peak, and
faster than two (docs/performance.md, "The smoke's memory")."""


@dataclass(frozen=True)
class SFTResult:
    """What the warm start did: steps, trained action tokens, and the loss curve."""

    optimizer_steps: int
    trained_action_tokens: int
    episodes: int
    losses: tuple[float, ...]


def action_tokens(episode: Episode) -> int:
    """The action tokens SFT trains on in ``episode``."""
    return sum(len(t.action_token_ids) for t in episode.turns)


def fit_to_budget(chunk: Sequence[Episode], remaining: int) -> tuple[list[Episode], bool]:
    """The prefix of ``chunk`` (at least one episode) whose action tokens come nearest
    ``remaining``, and whether that reaches the budget (the last batch of a matched run):
    True when the prefix was cut or its tokens reach ``remaining``."""
    cumulative, total = [], 0
    for ep in chunk:
        total += action_tokens(ep)
        cumulative.append(total)
    k = min(range(len(chunk)), key=lambda i: (abs(cumulative[i] - remaining), i))
    return list(chunk[: k + 1]), k + 1 < len(chunk) or cumulative[k] >= remaining


def sft_backward(
    model: torch.nn.Module,
    episodes: Sequence[Episode],
    pad_id: int,
    micro_batch_size: int,
) -> tuple[float, int]:
    """Backpropagate the token-mean NLL of the action tokens of ``episodes``.

    L = -(1/N) Σ_i Σ_t m_it log πθ(y_it), N = Σ m over all of ``episodes``; computed in
    micro-batches whose gradients add up to the whole one. Each micro-batch is one packed decoder
    call with the prompt prefix its rows share (the scaffold's system message) forwarded once
    (``common_prefix_lengths``, ``shared_prefix_logprobs``): equal to scoring every row on its
    own up to floating-point summation order. Returns (L, N).
    """
    shifted_all = shift_targets(build_training_batch(episodes, pad_id=pad_id))
    n_total = int(shifted_all.mask_B_T.sum())
    if n_total == 0:
        return 0.0, 0
    total = 0.0
    for start in range(0, len(episodes), micro_batch_size):
        batch = build_training_batch(episodes[start : start + micro_batch_size], pad_id=pad_id)
        mask = shift_targets(batch).mask_B_T
        ids, attn = batch.token_ids_B_T, batch.attention_mask_B_T
        logprobs = shared_prefix_logprobs(model, ids, attn, target_mask_B_T=mask,
                                          prefix_len_B=common_prefix_lengths(ids, attn, mask))
        loss = -(logprobs * mask).sum() / n_total
        loss.backward()
        total += float(loss.detach())
    return total, n_total


def supervised_warm_start(
    model: torch.nn.Module,
    episodes: Sequence[Episode],
    pad_id: int,
    *,
    epochs: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
    max_tokens: int | None = None,
    micro_batch_size: int = SFT_MICRO_BATCH,
    precision: str = "float32",
    progress: Callable[[int], None] | None = None,
) -> SFTResult:
    """Train on ``episodes`` for ``epochs`` passes of shuffled mini-batches.

    ``max_tokens`` stops once that many action tokens have been trained on (used to match the
    SFT-only control's budget to an RL arm's): the batch that reaches it is cut to the prefix
    of its episodes whose action tokens come nearest the remaining budget (``fit_to_budget``),
    so the total lands within half an episode of it instead of a whole batch past it.
    ``precision`` is the run's matmul precision (``closedloop.engine.precision``: the run
    resolves it once, and the warm start uses the same one as sampling and training); the
    weights and the optimizer stay float32.
    """
    if not episodes:
        raise LearnError("no demonstrations to train on")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=learning_rate)
    rng = random.Random(seed)
    order = list(range(len(episodes)))
    losses: list[float] = []
    trained = 0
    steps = 0
    model.train()
    for _ in range(epochs):
        rng.shuffle(order)
        for start in range(0, len(order), batch_size):
            chunk = [episodes[i] for i in order[start : start + batch_size]]
            last = False
            if max_tokens is not None:
                chunk, last = fit_to_budget(chunk, max_tokens - trained)
            optimizer.zero_grad(set_to_none=True)
            with matmul_precision(model, precision):
                loss, n = sft_backward(model, chunk, pad_id, micro_batch_size)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            trained += n
            steps += 1
            losses.append(loss)
            if progress is not None:
                progress(len(chunk))
            if max_tokens is not None and (last or trained >= max_tokens):
                return SFTResult(steps, trained, len(episodes), tuple(losses))
    return SFTResult(steps, trained, len(episodes), tuple(losses))
