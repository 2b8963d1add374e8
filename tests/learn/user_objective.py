"""Objectives defined outside the closedloop package, as a user would write them: plain
classes meeting the ``Objective`` protocol (``name``, ``uses_ratio``, ``__call__``), built by
factories that take the run's ``ClipRange``; a run config names them by dotted path
(``tests.learn.user_objective:sign_reinforce``) without registering anything.

``SignReinforce``: REINFORCE on the sign of the advantage,
L = R_w(-sign(A_i) · log πθ(a_it)) + β · R_w(k(a_it)); ratio-free, so one optimizer step per
fresh batch. ``SignPPO`` is the clipped-ratio version (``uses_ratio`` True). ``CALLS`` records
the batch size of every evaluation, so a test can see the run applied it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from closedloop.contracts.update import ObjectiveInputs, ObjectiveOutput
from closedloop.learn.objectives import ClipRange
from closedloop.learn.objectives.diagnostics import finish
from closedloop.learn.objectives.inputs import prepare

CALLS: list[int] = []
"""Episodes of each batch an objective of this module evaluated (in this process)."""


@dataclass(frozen=True)
class SignReinforce:
    """REINFORCE (+ KL) on sign(A_i) (see the module docstring)."""

    name: str = "sign_reinforce"
    uses_ratio: bool = False

    def __call__(self, inputs: ObjectiveInputs) -> ObjectiveOutput:
        """∂L/∂log πθ(a_it) = -w_it · sign(A_i) on the action tokens."""
        batch = prepare(inputs)
        sign_B_T = torch.sign(batch.adv_B)[:, None].expand_as(batch.weights)
        pg_loss = (batch.weights * (-sign_B_T * batch.new)).sum()
        CALLS.append(int(batch.adv_B.shape[0]))
        return finish(self.name, inputs, batch, pg_loss, -batch.weights * sign_B_T, None)


@dataclass(frozen=True)
class SignPPO(SignReinforce):
    """The same loss, declared to weigh πθ against π_beh (so it may reuse a batch)."""

    name: str = "sign_ppo"
    uses_ratio: bool = True
    eps: float = 0.2


def sign_reinforce(clip: ClipRange) -> SignReinforce:
    """The factory a config's ``update.objective`` names (ratio-free: ``clip`` unused)."""
    return SignReinforce()


def sign_ppo(clip: ClipRange) -> SignPPO:
    """A factory whose objective uses ratios, with the run's ε bound."""
    return SignPPO(eps=clip.eps)


def not_an_objective(clip: ClipRange) -> object:
    """A factory whose product lacks the protocol (no ``uses_ratio``)."""
    return lambda inputs: None


NOT_A_FACTORY = 3
"""A dotted path may name only a callable."""
