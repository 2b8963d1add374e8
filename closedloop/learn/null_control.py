"""The reward nulls of the controlled experiment (docs/null-control.md; docs/concepts.md, four
controls): rewards relabelled within each group so that they carry no information about which
episode earned them, while the update machinery (sampling, selection, credit, reduction, KL,
optimizer) runs unchanged.

- ``shuffle_within_group``: the scored rewards of a group permuted uniformly (π drawn from a
  generator seeded by the group id). For every member, E_π[A'_i] = 0 under RLOO, GRPO (the
  group's std is permutation invariant) and Dr. GRPO, so any loss *linear in the advantages*
  with weights that do not depend on them (REINFORCE with any reducer: episode_sum,
  token_mean, length_normalized, turn_mass_conserving; a clipped ratio objective while ρ = 1)
  has zero expected gradient given the sampled episodes.
- ``shuffle_flip_within_group``: the shuffle, then, with probability ½ (a second seeded coin
  per group), every scored reward reflected about the group mean, r' = 2 r̄ − r, which negates
  each member's advantage under the three estimators. The advantage vector's distribution is
  then symmetric under negation, so the expected update is zero for any update rule *odd* in
  the gradient as well: the norm clip, sign-like steps such as Adam's first one (a plain
  shuffle of a skewed group, one success among several failures, biases sign(g)).

Neither null is zero-push for a clipped ratio objective once ρ ≠ 1 (a reused batch's later
passes, or a generator/trainer mismatch): the clip binds on one advantage sign only, and no
relabelling of rewards can make E[A' · 1(unclipped)] vanish for every ratio (see the docs).

The reflection keeps the censored members' ``None`` and leaves a group whose scored rewards are
equal unchanged (its members' advantages stay 0; the group is discarded alike), so the selection
of trained episodes is the same as under the real rewards.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Literal

from closedloop.errors import LearnError, UnknownNameError

__all__ = ["NULL_CONTROLS", "RewardControl", "control_rewards", "relabel"]

RewardControl = Literal["none", "shuffle_within_group", "shuffle_flip_within_group"]
NULL_CONTROLS = ("shuffle_within_group", "shuffle_flip_within_group")
"""The reward controls that are nulls (``none`` is the RL arm's real reward)."""


def relabel(rewards: Sequence[float | None], perm: Sequence[int],
            flip: bool) -> list[float | None]:
    """The scored rewards (not ``None``) permuted by ``perm`` (a permutation of the scored
    positions, in order: scored member k takes the reward of scored member ``perm[k]``), then
    reflected about their mean when ``flip``; ``None`` stays in place."""
    scored = [i for i, r in enumerate(rewards) if r is not None]
    if sorted(perm) != list(range(len(scored))):
        raise LearnError(f"perm {list(perm)} is not a permutation of {len(scored)} members")
    values = [float(rewards[scored[j]]) for j in perm]  # type: ignore[arg-type]
    if flip and values:
        mean = sum(values) / len(values)
        values = [2.0 * mean - v for v in values]
    out = list(rewards)
    for i, v in zip(scored, values, strict=True):
        out[i] = v
    return out


def control_rewards(rewards: Sequence[float | None], control: str,
                    group_id: str) -> list[float | None]:
    """The rewards a group trains on under ``control``: unchanged for ``none``; otherwise
    ``relabel`` with a permutation (and, for the flip null, a coin) drawn from generators
    seeded by ``group_id``, so a resumed run relabels identically."""
    if control == "none":
        return list(rewards)
    if control not in NULL_CONTROLS:
        raise UnknownNameError("reward control", control, ("none", *NULL_CONTROLS))
    n = sum(r is not None for r in rewards)
    perm = list(range(n))
    random.Random(f"shuffle/{group_id}").shuffle(perm)
    flip = control == "shuffle_flip_within_group" and \
        random.Random(f"flip/{group_id}").random() < 0.5
    return relabel(rewards, perm, flip)
