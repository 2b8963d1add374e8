"""Objectives by name: what a config's ``update.objective`` and a run's ``trainer.json`` name.

``get_objective(name)`` returns a :class:`BoundObjective`, which satisfies the
:class:`~closedloop.contracts.update.Objective` protocol: one
:class:`~closedloop.contracts.update.ObjectiveInputs` in, one
:class:`~closedloop.contracts.update.ObjectiveOutput` out. ``uses_ratio`` says whether its loss
weighs πθ against π_beh through ρ = πθ/π_beh (with a clip): only such an objective may take
several optimizer steps on one fresh batch, since after the first step πθ ≠ π_beh and a
ratio-free objective would follow the wrong gradient. ``get_objective`` raises
:class:`UnknownObjectiveError` naming the known objectives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from closedloop.contracts.update import Objective, ObjectiveInputs, ObjectiveOutput
from closedloop.errors import UnknownObjectiveError
from closedloop.learn.objectives.surrogates import (
    ClipRange,
    normalized_ratio_clip,
    ppo_clip,
    reinforce_with_kl,
)

__all__ = ["OBJECTIVES", "BoundObjective", "UnknownObjectiveError", "get_objective"]


@dataclass(frozen=True)
class BoundObjective:
    """A named objective with its hyperparameters bound: ``objective(inputs) -> output``.

    Satisfies :class:`~closedloop.contracts.update.Objective`.
    """

    name: str
    uses_ratio: bool
    fn: Callable[[ObjectiveInputs], ObjectiveOutput]

    def __call__(self, inputs: ObjectiveInputs) -> ObjectiveOutput:
        """Evaluate the objective on one batch."""
        return self.fn(inputs)


def _bind(name: str, clip: ClipRange) -> Callable[[ObjectiveInputs], ObjectiveOutput]:
    if name == "reinforce_with_kl":
        return reinforce_with_kl
    if name == "ppo_clip":
        return lambda inputs: ppo_clip(inputs, clip)
    if name == "normalized_ratio_clip[sequence]":
        return lambda inputs: normalized_ratio_clip(inputs, "sequence", clip)
    return lambda inputs: normalized_ratio_clip(inputs, "turn", clip)


OBJECTIVES: dict[str, bool] = {
    "reinforce_with_kl": False,
    "ppo_clip": True,
    "normalized_ratio_clip[sequence]": True,
    "normalized_ratio_clip[turn]": True,
}
"""Registered name -> ``uses_ratio``. Each name equals the ``objective`` its outputs carry."""


def get_objective(name: str, clip: ClipRange | None = None) -> Objective:
    """The objective registered as ``name``, with ``clip`` (default ``ClipRange()``) bound for
    the clipped ones."""
    if name not in OBJECTIVES:
        raise UnknownObjectiveError(f"unknown objective {name!r}; known: {sorted(OBJECTIVES)}")
    return BoundObjective(name, OBJECTIVES[name], _bind(name, clip or ClipRange()))
