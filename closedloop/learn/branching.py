"""Branching credit: the advantage of a continuation among K forked from one decision state
(branching credit, docs/credit.md).

The K continuations τ_{t,1} … τ_{t,K} of one agent prefix B_t share the world state S_t, the
exact context, the behaviour policy and the budgets; they differ only by policy sampling. With
G_{t,k} the verified return of continuation k,

    A_{t,k} = G_{t,k} - (1/(K-1)) Σ_{j≠k} G_{t,j}

(leave-one-out over the scored continuations; a censored one is dropped, never scored 0, and
fewer than two scored ones discard the set). A_{t,k} is an estimate of Q(h_t, a_{t,k}) - V(h_t)
for the continuation's first action, closer to a local counterfactual than a comparison of
trajectories from unrelated starts; it lands only on the branch's own action tokens (turns
>= t: the prefix is the parent's and carries ``action_mask`` 0 in the branch's record).

:func:`branch_compute` counts what the branches cost: continuations, their own turns and
action tokens (the copied prefix excluded), for the report beside the gain.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from closedloop.contracts import Episode
from closedloop.learn.credit import GroupCredit, group_advantages

__all__ = ["BranchCompute", "branch_compute", "branch_credit"]


def branch_credit(branches: Sequence[Episode]) -> GroupCredit:
    """A_{t,k} of the module docstring for the K branches of one prefix (``rloo`` under
    ``drop_censored``; ``GroupCredit.member_indices`` names the scored branches)."""
    rewards = [ep.trajectory.task_success for ep in branches]
    censored = [ep.trajectory.termination.is_censored or ep.trajectory.quarantine_reason
                is not None or r is None for ep, r in zip(branches, rewards, strict=True)]
    return group_advantages(rewards, "rloo", censored, "drop_censored")


@dataclass(frozen=True)
class BranchCompute:
    """What branching cost: ``sets`` (branch points), ``continuations``, their own ``turns``
    and ``action_tokens`` (the copied prefix excluded)."""

    sets: int
    continuations: int
    turns: int
    action_tokens: int

    def to_dict(self) -> dict[str, int]:
        """The JSON form."""
        return {"sets": self.sets, "continuations": self.continuations, "turns": self.turns,
                "action_tokens": self.action_tokens}


def branch_compute(groups: Sequence[Sequence[Episode]]) -> BranchCompute:
    """Count the branches of ``groups`` (one sequence of continuations per branch point)."""
    eps = [ep for g in groups for ep in g]
    own = [t for ep in eps for t in ep.turns if t.continuation_parent is None]
    return BranchCompute(len(groups), len(eps), len(own),
                         sum(sum(t.action_mask) for t in own))
