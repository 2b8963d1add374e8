"""What a generator is asked to collect: group specs and the work order of one round.

A *round* is the set of groups one RL step consumes: round ``r`` feeds the trainer's step ``r``
and is sampled by the behaviour version its ``WorkOrder`` names. Under the synchronous
schedule that version is ``v_r`` (the step's own start); under bounded asynchrony with lag
``L`` it is ``v_max(0, r - L)`` (bounded staleness, docs/concepts.md), so the generator can
sample round ``r`` while the trainer is still producing ``v_{r-L+1} .. v_r``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from closedloop.errors import ContractError

__all__ = ["GroupSpec", "WorkOrder", "scheduled_version_index"]


@dataclass(frozen=True)
class GroupSpec:
    """One group to collect: its id, task, seed and number of siblings G."""

    group_id: str
    task_id: str
    seed: int
    group_size: int

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values."""
        return {"group_id": self.group_id, "task_id": self.task_id, "seed": self.seed,
                "group_size": self.group_size}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GroupSpec:
        """The spec ``to_dict`` wrote (``ContractError`` naming the field otherwise)."""
        try:
            spec = cls(str(data["group_id"]), str(data["task_id"]), int(data["seed"]),
                       int(data["group_size"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ContractError(f"group spec: {exc!r}") from None
        if spec.group_size < 1:
            raise ContractError(f"group spec {spec.group_id}: group_size must be >= 1")
        return spec


@dataclass(frozen=True)
class WorkOrder:
    """The groups of round ``round`` and the behaviour version that samples them."""

    round: int
    behavior_version: str
    groups: tuple[GroupSpec, ...]

    @property
    def episodes(self) -> int:
        """Episodes the round holds (the sum of its groups' G)."""
        return sum(g.group_size for g in self.groups)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (what a checkpoint keeps of the rounds it has drawn)."""
        return {"round": self.round, "behavior_version": self.behavior_version,
                "groups": [g.to_dict() for g in self.groups]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WorkOrder:
        """The order ``to_dict`` wrote."""
        try:
            groups = tuple(GroupSpec.from_dict(g) for g in data["groups"])
            return cls(int(data["round"]), str(data["behavior_version"]), groups)
        except (KeyError, TypeError, ValueError) as exc:
            raise ContractError(f"work order: {exc!r}") from None


def scheduled_version_index(round_index: int, max_version_lag: int) -> int:
    """The behaviour version index that samples round ``round_index``: ``max(0, r - L)``.

    ``L = 0`` is the synchronous schedule (round r by v_r); with ``L >= 1`` a round is sampled
    ``L`` versions behind the update that consumes it, so the version gap of every trained
    group is at most ``L`` (exactly ``L`` after the first ``L`` rounds).
    """
    if round_index < 0 or max_version_lag < 0:
        raise ContractError(f"round {round_index} and lag {max_version_lag} must be >= 0")
    return max(0, round_index - max_version_lag)


def orders_to_list(orders: Sequence[WorkOrder]) -> list[dict[str, Any]]:
    """The orders as JSON values, by round."""
    return [o.to_dict() for o in sorted(orders, key=lambda o: o.round)]
