"""Potential-based shaping: hand-worked terms with the terminal convention Φ(terminal) = 0, and
the telescoping check Σ γ^k F_k = -Φ(s_0) + γ^K Φ'(s_K) on recorded key-and-door episodes
(terminal and truncated), with Φ from the package over the replayed true states."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from closedloop.contracts import SamplerConfig, sha256_hex
from closedloop.errors import LearnError
from closedloop.learn.recurrent_ac import FeatureRenderer
from closedloop.learn.shaping import recorded_shaping, shaping_telescoping, shaping_terms
from closedloop.rollout.source import ScriptedSource
from closedloop.training.wiring import CollectorParts, build_manifest, make_collector
from tests.learn.keydoor_traces import collect_keydoor, feature_policy, keydoor, keydoor_tasks


def test_shaping_terms_hand_worked() -> None:
    # γ=.9, Φ = [0, .2, .5, 1.0], terminal: Φ'(s_3) = 0 -> F = [.18, .25, -.5]
    torch.testing.assert_close(shaping_terms([0, 0.2, 0.5, 1.0], 0.9, terminal=True),
                               torch.tensor([0.18, 0.25, -0.5], dtype=torch.float64))
    # truncated: Φ(s_3) kept -> F_2 = .9 - .5 = .4
    torch.testing.assert_close(shaping_terms([0, 0.2, 0.5, 1.0], 0.9, terminal=False),
                               torch.tensor([0.18, 0.25, 0.4], dtype=torch.float64))
    assert shaping_telescoping([0.3, 0.2, 0.5, 1.0], 0.9, True) == pytest.approx((-0.3, -0.3))
    with pytest.raises(LearnError):
        shaping_terms([], 0.9, True)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-3, 3), min_size=1, max_size=12), st.floats(0, 1), st.booleans())
def test_shaping_telescopes_for_any_potential(phi, gamma, terminal) -> None:
    lhs, rhs = shaping_telescoping(phi, gamma, terminal)
    assert lhs == pytest.approx(rhs, abs=1e-9)


def _expert_episodes(tasks):
    pkg = keydoor()
    renderer = FeatureRenderer(pkg)
    manifest = build_manifest(policy_version="expert", weight_checksum=sha256_hex("expert"),
                              tokenizer_revision=sha256_hex("features"), renderer=renderer,
                              sampler=SamplerConfig(), step_budget=12, max_action_tokens=1,
                              model_id="expert")
    source = ScriptedSource(lambda task, key: pkg.scripted_policy("expert", task, 0),
                            renderer.encode)
    collector = make_collector(source, manifest, CollectorParts(renderer, pkg.verifier(), "x",
                                                                None, 12, pkg))
    leases = [collector.make_lease(f"e{i}", t, 1, 1) for i, t in enumerate(tasks)]
    return [ep for g in collector.collect(leases) for ep in g.episodes]


def test_the_expert_episode_has_the_potentials_the_state_implies() -> None:
    train, _ = keydoor_tasks(4, 2)
    pkg = keydoor()
    assert pkg.potential is not None
    for ep in _expert_episodes(train):
        assert ep.trajectory.task_success == 1.0
        shaped = recorded_shaping(ep, pkg.make_env(), pkg.potential, 0.9)
        assert shaped is not None and shaped.terminal
        # inspect (.2), the clue's key (.5), its door (1.0), finish: terminal, Φ' = 0
        assert shaped.potentials == pytest.approx((0.0, 0.2, 0.5, 1.0, 1.0))
        assert shaped.terms == pytest.approx((0.18, 0.25, 0.4, -1.0))
        assert shaped.discounted_sum == pytest.approx(shaped.boundary_term) == 0.0


def test_shaping_telescopes_on_recorded_episodes() -> None:
    pkg = keydoor()
    assert pkg.potential is not None
    train, heldout = keydoor_tasks(6, 4)
    model = feature_policy(seed=5)
    episodes = collect_keydoor(model, train + heldout, group_size=3, max_turns=3)
    episodes += collect_keydoor(model, train + heldout, group_size=3, salt=2)
    kinds = set()
    for ep in episodes:
        shaped = recorded_shaping(ep, pkg.make_env(), pkg.potential, 0.95)
        assert shaped is not None
        kinds.add(shaped.terminal)
        assert shaped.discounted_sum == pytest.approx(shaped.boundary_term, abs=1e-12)
        k = len(shaped.terms)
        phi_t = 0.0 if shaped.terminal else shaped.potentials[-1]
        assert shaped.boundary_term == pytest.approx(-shaped.potentials[0] + 0.95**k * phi_t)
    assert kinds == {True, False}  # terminal and truncated episodes were both checked
    # prekeyed held-out tasks start holding a key: Φ(s_0) = .3 when it is the exit's colour
    starts = {recorded_shaping(ep, pkg.make_env(), pkg.potential, 0.95).potentials[0]
              for ep in episodes}
    assert starts == {0.0, 0.3}
