"""The sampler's distribution: support, renormalization, greedy point mass, draws."""

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from closedloop.contracts import SamplerConfig
from closedloop.policy import sample, sample_step, transform_logits


def reference_logprobs(logits, sampler, boundary=None):
    """Independent float64 implementation of the documented transform (loops, no torch).

    ``boundary`` (a list) receives True when a top-p decision sat within 1e-9 of ``top_p``,
    where float rounding may legitimately decide either way."""
    z = np.asarray(logits, dtype=np.float64)
    if sampler.greedy:
        out = np.full_like(z, -np.inf)
        out[int(np.argmax(z))] = 0.0
        return out
    s = z / sampler.temperature
    keep = np.ones_like(s, dtype=bool)
    if sampler.top_k is not None and sampler.top_k < len(s):
        kth = np.sort(s)[::-1][sampler.top_k - 1]
        keep &= s >= kth
    if sampler.top_p < 1.0:
        q = np.where(keep, np.exp(s - s[keep].max()), 0.0)
        q /= q.sum()
        order = np.lexsort((np.arange(len(s)), -q))  # by probability desc, then lower id
        before = np.concatenate([[0.0], np.cumsum(q[order])[:-1]])  # mass strictly before
        drop = before >= sampler.top_p
        drop[0] = False
        keep[order[drop]] = False
        if boundary is not None and np.any(np.abs(before[1:] - sampler.top_p) < 1e-9):
            boundary.append(True)
    m = s[keep].max()
    lse = m + math.log(np.exp(s[keep] - m).sum())
    return np.where(keep, s - lse, -np.inf)


samplers = st.builds(
    SamplerConfig,
    temperature=st.floats(0.05, 5.0),
    top_p=st.floats(0.01, 1.0),
    top_k=st.one_of(st.none(), st.integers(1, 40)),
    greedy=st.booleans(),
)
logit_rows = st.lists(st.floats(-30, 30, allow_nan=False).map(lambda x: round(x, 1)),
                      min_size=2, max_size=40)


@settings(max_examples=150, deadline=None)
@given(logits=logit_rows, sampler=samplers, seed=st.integers(0, 2**31 - 1))
def test_draws_never_leave_the_truncated_support(logits, sampler, seed):
    logits_1_V = torch.tensor([logits], dtype=torch.float32)
    lp_1_V = transform_logits(logits_1_V, sampler)
    finite = torch.isfinite(lp_1_V[0])
    assert finite.any()
    assert math.isclose(float(lp_1_V[0][finite].exp().sum()), 1.0, abs_tol=1e-5)
    gen = torch.Generator().manual_seed(seed)
    ids = sample(lp_1_V.expand(200, -1), gen)  # 150 examples x 200 = 30,000 draws
    assert bool(finite[ids].all()), "a token outside the support was drawn"
    step = sample_step(logits_1_V.expand(50, -1), sampler, gen)
    assert bool(torch.isfinite(step.behavior_logprobs_B).all())
    assert bool((step.behavior_logprobs_B <= 1e-6).all())


@settings(max_examples=150, deadline=None)
@given(logits=logit_rows, sampler=samplers)
def test_transform_matches_independent_reference(logits, sampler):
    got = transform_logits(torch.tensor([logits], dtype=torch.float64), sampler)[0].numpy()
    boundary = []
    want = reference_logprobs(logits, sampler, boundary)
    assume(not boundary)  # a mass exactly at top_p: rounding may decide either way
    assert np.array_equal(np.isfinite(got), np.isfinite(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], atol=1e-9)


@settings(max_examples=100, deadline=None)
@given(logits=logit_rows, top_p=st.floats(0.01, 0.99), temperature=st.floats(0.1, 3.0))
def test_top_p_support_is_the_smallest_sufficient_prefix(logits, top_p, temperature):
    sampler = SamplerConfig(temperature=temperature, top_p=top_p)
    lp = transform_logits(torch.tensor([logits], dtype=torch.float64), sampler)[0]
    q = torch.softmax(torch.tensor(logits, dtype=torch.float64) / temperature, -1)
    kept = torch.isfinite(lp)
    mass = float(q[kept].sum())
    assert mass >= top_p - 1e-9 or bool(kept.all())
    assert mass - float(q[kept].min()) < top_p + 1e-9  # dropping any kept token goes below p
    assert float(q[kept].min()) >= float(q[~kept].max()) if (~kept).any() else True


def test_hand_worked_top_p():
    # softmax([2, 1, 0, -1]) = [0.6439, 0.2369, 0.0871, 0.0321]; mass before each token
    # = [0, 0.6439, 0.8808, 0.9679]; top_p = 0.7 keeps the first two, renormalized to
    # [0.7311, 0.2689] -> log-probs [-0.3133, -1.3133, -inf, -inf].
    lp = transform_logits(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), SamplerConfig(top_p=0.7))[0]
    assert lp[:2].tolist() == pytest.approx([-0.31326, -1.31326], abs=1e-4)
    assert lp[2:].tolist() == [float("-inf")] * 2


def test_top_k_keeps_ties_at_the_threshold():
    lp = transform_logits(torch.tensor([[3.0, 1.0, 1.0, 0.0]]), SamplerConfig(top_k=2))[0]
    assert torch.isfinite(lp).tolist() == [True, True, True, False]


def test_greedy_is_a_point_mass_with_logprob_zero():
    logits = torch.tensor([[0.1, 2.0, 2.0, -1.0], [5.0, 0.0, 0.0, 0.0]])
    step = sample_step(logits, SamplerConfig(greedy=True), torch.Generator().manual_seed(0))
    assert step.ids_B.tolist() == [1, 0]
    assert step.behavior_logprobs_B.tolist() == [0.0, 0.0]
    assert step.raw_logprobs_B[0] == pytest.approx(float(torch.log_softmax(logits[0], 0)[1]))


def test_draw_frequencies_follow_the_transformed_distribution():
    logits_1_V = torch.tensor([[2.0, 1.5, 0.5, 0.0, -3.0]])
    sampler = SamplerConfig(temperature=0.7, top_p=0.9)
    probs = transform_logits(logits_1_V, sampler)[0].exp()
    ids = sample(transform_logits(logits_1_V.expand(20000, -1), sampler),
                 torch.Generator().manual_seed(3))
    freq = torch.bincount(ids, minlength=5).double() / 20000
    # binomial std <= sqrt(0.25 / 20000) = 0.0035; 0.015 is > 4 std
    assert torch.allclose(freq, probs.double(), atol=0.015)
    assert freq[probs == 0].sum() == 0


@pytest.mark.parametrize(("u", "row", "want"), [
    (0.0, [math.log(0.5), math.log(0.5), -math.inf, -math.inf], 0),
    (1.0 - 2.0 ** -53, [math.log(0.5), math.log(0.5), -math.inf, -math.inf], 1),
    (0.0, [-math.inf, 0.0, -math.inf], 1),
    (1.0 - 2.0 ** -53, [-math.inf, 0.0, -math.inf], 1),
    (0.5 - 1e-12, [math.log(0.5), -math.inf, math.log(0.5)], 0),
    (0.5 + 1e-12, [math.log(0.5), -math.inf, math.log(0.5)], 2),
])
def test_inverse_cdf_edges_never_land_outside_the_support(monkeypatch, u, row, want):
    # The extreme uniforms (0 and the largest double below 1) and both sides of a boundary
    # next to an excluded token: the draw is the token whose CDF interval holds u.
    def fixed_rand(shape, **kwargs):
        return torch.full(shape, u, dtype=kwargs.get("dtype", torch.float32))

    monkeypatch.setattr(torch, "rand", fixed_rand)
    assert sample(torch.tensor([row])).tolist() == [want]


def test_tiny_probabilities_keep_their_own_interval():
    # One token holds 1 - 2e-9 of the mass, two hold 1e-9 each: a float32 running sum would round
    # both away (its spacing near 1 is 6e-8), so they could never be drawn. Pin the uniform just
    # past the head token's interval: the first tail token is drawn.
    row = torch.tensor([[math.log1p(-2e-9), math.log(1e-9), math.log(1e-9)]])
    gen = torch.Generator().manual_seed(0)
    assert sample(row, gen).tolist() == [0]
    u = 1.0 - 1.5e-9
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "rand", lambda shape, **kw: torch.full(shape, u, dtype=kw["dtype"]))
        assert sample(row).tolist() == [1]


def test_row_generators_make_each_row_independent_of_its_batch():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    lp = transform_logits(logits, SamplerConfig(temperature=0.7))
    rows = [torch.Generator().manual_seed(10 + b) for b in range(5)]
    batched = sample(lp, rows)
    for b in range(5):  # row b alone, from a fresh copy of its own stream
        alone = sample(lp[b:b + 1], [torch.Generator().manual_seed(10 + b)])
        assert int(alone[0]) == int(batched[b])
    with pytest.raises(ValueError):
        sample(lp, rows[:2])


def test_common_streams_disagree_at_most_by_the_cdf_distance():
    """Two close peaked distributions inverted at the same uniforms differ on a fraction of rows
    bounded by sum_i |F(i) - G(i)| (the coupling paired evaluations rely on)."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(1, 40, generator=g) * 3
    near = base + torch.randn(1, 40, generator=g) * 0.05
    p, q = (torch.log_softmax(x, -1).expand(4000, -1) for x in (base, near))
    a = sample(p, torch.Generator().manual_seed(5))
    b = sample(q, torch.Generator().manual_seed(5))
    cdf_gap = float((p[0].exp().cumsum(-1) - q[0].exp().cumsum(-1)).abs().sum())
    disagree = float((a != b).double().mean())
    assert cdf_gap < 0.1 and disagree <= cdf_gap + 0.01
    c = sample(q, torch.Generator().manual_seed(6))  # independent draws disagree far more often
    assert float((a != c).double().mean()) > 5 * disagree
