"""Policy-update objectives: one inputs record in, one output record out, chosen by name.

- :mod:`~closedloop.learn.objectives.inputs`: :class:`ObjectiveInputs` (πθ, π_beh and π_ref
  log-probs, advantages, mask, turn ids, reducer, KL placement) and :class:`ObjectiveOutput`
  (loss, KL, ratio tails, clip fractions, gradient mass);
- :mod:`~closedloop.learn.objectives.surrogates`: ``reinforce_with_kl``, ``ppo_clip``,
  ``normalized_ratio_clip`` (formulas in their docstrings);
- :mod:`~closedloop.learn.objectives.diagnostics`: the KL term and the statistics every
  objective reports;
- :mod:`~closedloop.learn.objectives.registry`: ``get_objective(name)`` and which objectives use
  ratios (and so may reuse a batch for several optimizer steps).
"""

from closedloop.learn.objectives.diagnostics import token_entropy
from closedloop.learn.objectives.inputs import (
    NonFiniteLogprobError,
    ObjectiveInputs,
    ObjectiveOutput,
)
from closedloop.learn.objectives.registry import (
    OBJECTIVES,
    Objective,
    UnknownObjectiveError,
    get_objective,
)
from closedloop.learn.objectives.surrogates import (
    ClipRange,
    Granularity,
    normalized_ratio_clip,
    ppo_clip,
    reinforce_with_kl,
)

__all__ = [
    "OBJECTIVES",
    "ClipRange",
    "Granularity",
    "NonFiniteLogprobError",
    "Objective",
    "ObjectiveInputs",
    "ObjectiveOutput",
    "UnknownObjectiveError",
    "get_objective",
    "normalized_ratio_clip",
    "ppo_clip",
    "reinforce_with_kl",
    "token_entropy",
]
