"""Policy-update objectives: one inputs record in, one output record out, chosen by name or by
a dotted path, extensible with ``register_objective(name, factory)``.

Each satisfies :class:`closedloop.contracts.update.Objective`: it reads one
:class:`~closedloop.contracts.update.ObjectiveInputs` (πθ, π_beh and π_ref log-probs,
advantages, mask, turn ids, reducer, KL placement) and returns one
:class:`~closedloop.contracts.update.ObjectiveOutput` (loss, KL, ratio tails, clip fractions,
gradient mass).

- :mod:`~closedloop.learn.objectives.inputs`: ``prepare``, the validation of a batch;
- :mod:`~closedloop.learn.objectives.surrogates`: ``reinforce_with_kl``, ``ppo_clip``,
  ``normalized_ratio_clip`` (formulas in their docstrings);
- :mod:`~closedloop.learn.objectives.diagnostics`: the KL term and the statistics every
  objective reports;
- :mod:`~closedloop.learn.objectives.registry`: ``register_objective(name, factory)``,
  ``get_objective(name or "pkg.module:attr")`` and the objective contract a user objective
  meets (its ``uses_ratio`` says whether it may reuse a batch for several optimizer steps).
"""

from closedloop.errors import (
    InvalidObjectiveError,
    NonFiniteLogprobError,
    UnknownObjectiveError,
)
from closedloop.learn.objectives.diagnostics import ratio_stats, token_entropy
from closedloop.learn.objectives.registry import (
    OBJECTIVES,
    BoundObjective,
    ObjectiveFactory,
    get_objective,
    register_objective,
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
    "BoundObjective",
    "ClipRange",
    "Granularity",
    "InvalidObjectiveError",
    "NonFiniteLogprobError",
    "ObjectiveFactory",
    "UnknownObjectiveError",
    "get_objective",
    "normalized_ratio_clip",
    "ppo_clip",
    "ratio_stats",
    "register_objective",
    "reinforce_with_kl",
    "token_entropy",
]
