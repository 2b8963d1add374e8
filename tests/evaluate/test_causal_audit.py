"""The causal audit on key-and-door, where each action's effect is known from the rules: the
interventions measure it, a credit that tracks it (the rise in the state's potential) is
separated from its within-episode shuffle with intervals, and the outcome-only arm cannot rank
an episode's actions."""

from __future__ import annotations

import itertools

import pytest

from closedloop.contracts import Action
from closedloop.errors import CausalAuditError
from closedloop.evaluate.causal_audit import (
    causal_audit,
    intervention_effect,
    outcome_only_credit,
    shuffled_credit,
    spearman,
)
from closedloop.learn.shaping import recorded_shaping
from tests.learn.keydoor_traces import collect_detours, keydoor, keydoor_tasks


def test_spearman_hand_worked() -> None:
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    # ties take average ranks: x ranks [0.5, 0.5, 2], y ranks [0, 1, 2] -> r = .866
    assert spearman([0, 0, 1], [1, 2, 3]) == pytest.approx(0.8660254)
    assert spearman([1, 1, 1], [1, 2, 3]) is None and spearman([1], [2]) is None


def _by_actions(episodes, names):
    for ep in episodes:
        if [t.tool_name or t.action_kind for t in ep.turns] == names:
            return ep
    raise AssertionError(f"no episode played {names}")


def test_interventions_measure_the_known_effects() -> None:
    pkg = keydoor()
    episodes = collect_detours(keydoor_tasks(32, 1)[0], group_size=2)
    verifier = pkg.verifier()
    plain = ["inspect", "pickup_red", "open_red", "finish"]
    blue = [n.replace("red", "blue") for n in plain]
    ep = next(e for e in episodes if [t.tool_name or t.action_kind for t in e.turns]
              in (plain, blue) and e.trajectory.task_success == 1.0)
    effects = [intervention_effect(ep, t, pkg.make_env, verifier, "delete") for t in range(4)]
    # open loop: without inspect the same keys and doors still win (0); without the key the
    # door is masked, without the door nothing opens (1); a deleted finish is closed by finish
    assert effects == [0.0, 1.0, 1.0, 0.0]
    assert intervention_effect(ep, 3, pkg.make_env, verifier, "delete", close=None) is None
    wrong_door = Action.tool(f"open_{'blue' if 'red' in ep.turns[2].tool_name else 'red'}")
    # the other door is masked while the exit's key is held: finish then ends with none open
    assert intervention_effect(ep, 2, pkg.make_env, verifier, "replace",
                               lambda e, t: wrong_door) == 1.0
    # on a tight task a detour is fatal: deleting the wasted inspect saves the episode (-1)
    tight = [e for e in episodes if "/tight/" in e.trajectory.task_id
             and [t.tool_name for t in e.turns][:2] == ["inspect", "inspect"]]
    assert tight and all(e.trajectory.task_success == 0.0 for e in tight)
    assert intervention_effect(tight[0], 1, pkg.make_env, verifier, "delete") == -1.0
    with pytest.raises(CausalAuditError):
        intervention_effect(ep, 1, pkg.make_env, verifier, "replace")


def test_the_audit_separates_a_tracking_credit_from_its_shuffle() -> None:
    pkg = keydoor()
    assert pkg.potential is not None
    episodes = collect_detours(keydoor_tasks(32, 1)[0], group_size=2)
    progress = {}
    for ep in episodes:  # the rise of Φ over the true state: a dense score that tracks effect
        phi = recorded_shaping(ep, pkg.make_env(), pkg.potential, 1.0).potentials
        progress[ep.trajectory.episode_id] = [b - a for a, b in itertools.pairwise(phi)]
    arms = {"progress": progress, "outcome_only": outcome_only_credit(episodes),
            **{f"shuffled-{s}": shuffled_credit(progress, s) for s in range(4)}}
    result = causal_audit(episodes, arms, pkg.make_env, pkg.verifier(), n_boot=400, seed=1)
    tracking = result["progress"]
    assert tracking.within is not None and tracking.within.lo > 0.5
    assert tracking.pooled is not None and tracking.pooled.lo > 0.5
    assert tracking.top_minus_bottom is not None and tracking.top_minus_bottom.lo > 0.5
    for s in range(4):
        null = result[f"shuffled-{s}"]
        assert null.within is not None and null.within.hi < tracking.within.lo
        assert null.n_pairs == tracking.n_pairs  # the same interventions, other credits
    outcome = result["outcome_only"]
    assert outcome.within is None and outcome.top_minus_bottom is None  # all ties
    assert outcome.within_undefined == outcome.n_episodes - sum(
        1 for e in episodes if len(e.turns) < 2)
    assert outcome.pooled is not None  # it still says which episodes succeeded
