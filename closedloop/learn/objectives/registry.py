"""The objective registry: what a config's ``update.objective`` and a run's ``trainer.json``
name, extensible by users.

The contract of an objective (:class:`~closedloop.contracts.update.Objective`): an object
with

- ``name: str``, non-empty: the name its outputs carry (``ObjectiveOutput.objective``);
- ``uses_ratio: bool``: whether its loss weighs πθ against π_beh through a ratio
  ρ = πθ/π_beh (usually clipped). Only such an objective may take several optimizer steps on
  one fresh batch (``update.optimizer_steps_per_fresh_batch > 1``) or learn from truncated
  (top-k/top-p) sampling: after the first step πθ ≠ π_beh, and a ratio-free objective would
  follow the wrong gradient;
- ``__call__(inputs: ObjectiveInputs) -> ObjectiveOutput``: one batch in, one output out.
  ``loss`` carries the gradient (a scalar whose gradient reaches ``inputs.new_logprobs_B_T``
  only), every other field is detached and undefined metrics are ``None``, never 0. The
  built-ins validate the batch with ``closedloop.learn.objectives.inputs.prepare`` and
  assemble their output with ``closedloop.learn.objectives.diagnostics.finish`` (from the
  policy loss and its analytic per-token coefficient ∂pg_loss/∂log πθ, which adds the KL
  term and every statistic); a user objective may do the same.

An objective is made by a *factory*: a callable taking the run's :class:`ClipRange`
(``update.clip_eps``; a ratio-free objective ignores it) and returning the objective. A factory
is found by

1. a registered name: ``register_objective(name, factory)`` (the four built-ins are registered
   at import: ``reinforce_with_kl``, ``ppo_clip``, ``normalized_ratio_clip[sequence]``,
   ``normalized_ratio_clip[turn]``); the objective it makes must carry that ``name``;
2. a dotted path ``"pkg.module:attr"``, imported when the config loads: ``attr`` is the
   factory. Nothing needs registering, so a config can name an objective defined anywhere
   on the import path; the run records the path, and the gates that re-run the objective
   (``closedloop.evaluate.gates``) import it again.

``get_objective(spec, clip)`` resolves either and checks the result against the protocol
(``InvalidObjectiveError`` naming what is wrong); an unknown name raises
``UnknownObjectiveError`` listing the registered ones. Config load resolves
``update.objective`` once (``ConfigError`` naming the key) and takes ``uses_ratio`` from the
objective itself.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from closedloop.contracts.update import Objective, ObjectiveInputs, ObjectiveOutput
from closedloop.errors import InvalidObjectiveError, UnknownObjectiveError
from closedloop.learn.objectives.surrogates import (
    ClipRange,
    normalized_ratio_clip,
    ppo_clip,
    reinforce_with_kl,
)

__all__ = ["OBJECTIVES", "BoundObjective", "ObjectiveFactory", "UnknownObjectiveError",
           "get_objective", "register_objective"]

ObjectiveFactory = Callable[[ClipRange], Objective]
"""Makes an objective from the run's clip range (see the module docstring)."""

_DOTTED = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_REGISTRY: dict[str, ObjectiveFactory] = {}
OBJECTIVES: Mapping[str, ObjectiveFactory] = MappingProxyType(_REGISTRY)
"""Registered name -> factory (a read-only view; ``register_objective`` adds to it)."""


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


def register_objective(name: str, factory: ObjectiveFactory, *, replace: bool = False) -> None:
    """Register ``factory`` under ``name`` (what ``update.objective`` may then name).

    ``InvalidObjectiveError`` if the name is empty, contains ``:`` (reserved for dotted
    paths), is taken (unless ``replace``), or the factory is not callable. The objective is
    made and checked when it is resolved (``get_objective``), with the run's clip range.
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise InvalidObjectiveError(f"objective name {name!r}: a non-empty string without ':'")
    if not callable(factory):
        raise InvalidObjectiveError(f"objective {name!r}: the factory {factory!r} is not "
                                    "callable")
    if name in _REGISTRY and not replace and _REGISTRY[name] is not factory:
        raise InvalidObjectiveError(f"objective {name!r} is already registered (pass "
                                    "replace=True to replace it)")
    _REGISTRY[name] = factory


def get_objective(spec: str, clip: ClipRange | None = None) -> Objective:
    """The objective ``spec`` names (a registered name or ``"pkg.module:attr"``), made with
    ``clip`` (default ``ClipRange()``) and checked against the ``Objective`` protocol."""
    if not isinstance(spec, str):
        raise UnknownObjectiveError(f"objective {spec!r} is not a string")
    if ":" in spec:
        factory, expected = _load_dotted(spec), None
    elif spec in _REGISTRY:
        factory, expected = _REGISTRY[spec], spec
    else:
        raise UnknownObjectiveError(f"unknown objective {spec!r}; known: {sorted(_REGISTRY)}, "
                                    "or a dotted path 'pkg.module:attr' to a factory")
    try:
        made = factory(clip or ClipRange())
    except Exception as exc:  # a user factory's own error, named
        raise InvalidObjectiveError(f"objective {spec!r}: its factory raised "
                                    f"{type(exc).__name__}: {exc}") from exc
    return _checked(made, spec, expected)


def _load_dotted(spec: str) -> ObjectiveFactory:
    """The factory ``"pkg.module:attr"`` names (``UnknownObjectiveError`` if it is not there)."""
    if not _DOTTED.match(spec):
        raise UnknownObjectiveError(f"objective {spec!r} is not a dotted path 'pkg.module:attr'")
    module_name, attr = spec.split(":", 1)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise UnknownObjectiveError(f"objective {spec!r}: cannot import {module_name!r}: "
                                    f"{exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UnknownObjectiveError(f"objective {spec!r}: {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise InvalidObjectiveError(f"objective {spec!r} is {type(obj).__name__}, not a "
                                    "factory (a callable taking the run's ClipRange)")
    factory: ObjectiveFactory = obj
    return factory


def _checked(made: Any, spec: str, expected: str | None) -> Objective:
    """``made`` if it satisfies the ``Objective`` protocol with a well-typed name and
    ``uses_ratio`` (and carries ``expected`` as its name, for a registered one)."""
    if not isinstance(made, Objective):
        raise InvalidObjectiveError(f"objective {spec!r}: its factory returned "
                                    f"{type(made).__name__}, which lacks the Objective "
                                    "protocol (name, uses_ratio, __call__(inputs) -> output)")
    if not isinstance(made.name, str) or not made.name:
        raise InvalidObjectiveError(f"objective {spec!r}: name must be a non-empty string, got "
                                    f"{made.name!r}")
    if not isinstance(made.uses_ratio, bool):
        raise InvalidObjectiveError(f"objective {spec!r}: uses_ratio must be a bool, got "
                                    f"{made.uses_ratio!r}")
    if expected is not None and made.name != expected:
        raise InvalidObjectiveError(f"objective registered as {expected!r} names itself "
                                    f"{made.name!r}: the name its outputs carry must be the "
                                    "registered one")
    return made


def _builtin(name: str, uses_ratio: bool,
             bind: Callable[[ClipRange], Callable[[ObjectiveInputs], ObjectiveOutput]]) -> None:
    register_objective(name, lambda clip: BoundObjective(name, uses_ratio, bind(clip)))


_builtin("reinforce_with_kl", False, lambda clip: reinforce_with_kl)
_builtin("ppo_clip", True, lambda clip: lambda inputs: ppo_clip(inputs, clip))
_builtin("normalized_ratio_clip[sequence]", True,
         lambda clip: lambda inputs: normalized_ratio_clip(inputs, "sequence", clip))
_builtin("normalized_ratio_clip[turn]", True,
         lambda clip: lambda inputs: normalized_ratio_clip(inputs, "turn", clip))
