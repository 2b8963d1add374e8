"""Objectives: score-function equivalence, reducer weights, toy-logit sign, clip fractions,
analytic gradient coefficients vs autograd, a mask-shift mutation check, and the registry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from closedloop.contracts.update import ObjectiveInputs, ObjectiveOutput
from closedloop.learn import (
    REDUCERS,
    ClipRange,
    KLSpec,
    LearnError,
    MaskError,
    NonFiniteLogprobError,
    UnknownNameError,
    UnknownObjectiveError,
    get_objective,
    normalized_ratio_clip,
    ppo_clip,
    reducer_weights,
    reinforce_with_kl,
    token_entropy,
)
from closedloop.learn.objectives.diagnostics import RATIO_KEYS, ratio_stats

F64 = torch.float64

# Episodes with observation gaps (mask 0 between turns), different lengths and one empty row.
MASK = torch.tensor(
    [
        [0, 1, 1, 0, 0, 1, 1, 1],
        [1, 1, 1, 1, 1, 1, 1, 0],
        [0, 0, 0, 0, 1, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 1, 0, 1, 0],
    ]
)
TURNS = torch.tensor(
    [
        [-1, 0, 0, -1, -1, 1, 1, 1],
        [0, 0, 0, 1, 1, 2, 2, -1],
        [-1, -1, -1, -1, 0, -1, -1, -1],
        [-1] * 8,
        [0, -1, 1, -1, 2, -1, 3, -1],
    ]
)
B, T = MASK.shape
LENGTHS = MASK.sum(dim=1).to(F64)  # [5, 7, 1, 0, 4]


class TinyPolicy:
    """A linear layer over fixed random features -> logits over a small vocabulary."""

    def __init__(self, seed: int = 0, n_features: int = 5, vocab: int = 7) -> None:
        g = torch.Generator().manual_seed(seed)
        self.features = torch.randn(B, T, n_features, generator=g, dtype=F64)
        self.layer = torch.nn.Linear(n_features, vocab, dtype=F64)
        with torch.no_grad():
            self.layer.weight.copy_(torch.randn(vocab, n_features, generator=g, dtype=F64))
            self.layer.bias.copy_(torch.randn(vocab, generator=g, dtype=F64))
        self.tokens = torch.randint(0, vocab, (B, T), generator=g)
        self.advantages = torch.randn(B, generator=g, dtype=F64)

    def logits(self) -> torch.Tensor:
        return self.layer(self.features)

    def logprobs(self) -> torch.Tensor:
        logp = torch.log_softmax(self.logits(), dim=-1)
        return logp.gather(-1, self.tokens[..., None]).squeeze(-1)

    def grad(self, loss: torch.Tensor) -> torch.Tensor:
        grads = torch.autograd.grad(loss, list(self.layer.parameters()))
        return torch.cat([g.reshape(-1) for g in grads])


def _objective_grad(policy: TinyPolicy, mask: torch.Tensor, reducer: str) -> torch.Tensor:
    new = policy.logprobs()
    out = reinforce_with_kl(ObjectiveInputs(
        new_logprobs_B_T=new,
        behavior_logprobs_B_T=new.detach(),
        advantages_B=policy.advantages,
        mask_B_T=mask,
        turn_ids_B_T=TURNS,
        reducer=reducer,
    ))
    return policy.grad(out.loss)


def _direct_grad(policy: TinyPolicy, token_weight_B: torch.Tensor) -> torch.Tensor:
    """∇ of -Σ_i c_i A_i Σ_{t∈M_i} log π, written out directly with the true mask."""
    logp = policy.logprobs() * MASK
    loss = -(token_weight_B * policy.advantages * logp.sum(dim=1)).sum()
    return policy.grad(loss)


def _safe_inv(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 0, 1.0 / x.clamp(min=1.0), 0.0)


def test_episode_sum_is_the_score_function_gradient() -> None:
    # (1/B) Σ_i A_i Σ_t ∇log π: per-token weight 1/B, independent of any sampled length.
    policy = TinyPolicy()
    got = _objective_grad(policy, MASK, "episode_sum")
    want = _direct_grad(policy, torch.full((B,), 1.0 / B, dtype=F64))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)


def test_length_normalized_and_token_mean_weight_tokens_differently() -> None:
    policy = TinyPolicy()
    episode = _objective_grad(policy, MASK, "episode_sum")
    length_norm = _objective_grad(policy, MASK, "length_normalized")
    token_mean = _objective_grad(policy, MASK, "token_mean")
    # expected per-token weights: 1/(B T_i) and 1/Σ_i T_i
    torch.testing.assert_close(
        length_norm, _direct_grad(policy, _safe_inv(LENGTHS) / B), rtol=1e-6, atol=1e-9
    )
    torch.testing.assert_close(
        token_mean,
        _direct_grad(policy, torch.full((B,), 1.0 / float(LENGTHS.sum()), dtype=F64)),
        rtol=1e-6,
        atol=1e-9,
    )
    for other in (length_norm, token_mean):
        assert not torch.allclose(episode, other, rtol=1e-3, atol=1e-6)
    assert not torch.allclose(length_norm, token_mean, rtol=1e-3, atol=1e-6)


def test_mask_shifted_by_one_breaks_the_score_function_check() -> None:
    # Mutation sanity: the equality above must be able to fail. Shifting the mask one position
    # right (the classic target-alignment bug) trains the wrong tokens.
    policy = TinyPolicy()
    shifted = torch.roll(MASK, shifts=1, dims=1)
    shifted[:, 0] = 0
    shifted_turns = torch.where(shifted > 0, 0, -1)
    new = policy.logprobs()
    out = reinforce_with_kl(ObjectiveInputs(
        new_logprobs_B_T=new,
        behavior_logprobs_B_T=new.detach(),
        advantages_B=policy.advantages,
        mask_B_T=shifted,
        turn_ids_B_T=shifted_turns,
        reducer="episode_sum",
    ))
    got = policy.grad(out.loss)
    want = _direct_grad(policy, torch.full((B,), 1.0 / B, dtype=F64))
    assert not torch.allclose(got, want, rtol=1e-6, atol=1e-9)
    assert float((got - want).abs().max()) > 1e-3


def _objective(name: str) -> Callable[..., ObjectiveOutput]:
    """The registered objective ``name`` (ε = 0.2), called with the inputs' fields."""
    objective = get_objective(name, ClipRange(0.2))

    def fn(**fields: Any) -> ObjectiveOutput:
        return objective(ObjectiveInputs(**fields))

    return fn


OBJECTIVES = ["reinforce_with_kl", "ppo_clip", "normalized_ratio_clip[sequence]",
              "normalized_ratio_clip[turn]"]


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_toy_logit_step_moves_sampled_logprob_with_advantage_sign(
    objective: str, advantage: float
) -> None:
    # One softmax over 5 logits, one sampled action, one SGD step at π_beh = πθ.
    logits = torch.tensor([0.3, -0.2, 0.1, 0.5, -0.4], dtype=F64, requires_grad=True)
    action = 2
    before = float(torch.log_softmax(logits.detach(), -1)[action])
    logp = torch.log_softmax(logits, -1)[action].reshape(1, 1)
    out = _objective(objective)(
        new_logprobs_B_T=logp,
        behavior_logprobs_B_T=logp.detach(),
        advantages_B=torch.tensor([advantage], dtype=F64),
        mask_B_T=torch.ones(1, 1),
        turn_ids_B_T=torch.zeros(1, 1, dtype=torch.long),
    )
    out.loss.backward()
    assert logits.grad is not None
    with torch.no_grad():
        after = float(torch.log_softmax(logits - 0.5 * logits.grad, -1)[action])
    assert (after - before) * advantage > 0


@pytest.mark.parametrize(
    ("objective", "reducer"),
    [
        ("ppo_clip", "episode_sum"),
        ("ppo_clip", "turn_mass_conserving"),
        ("normalized_ratio_clip[sequence]", "episode_sum"),
        ("normalized_ratio_clip[sequence]", "length_normalized"),
        ("normalized_ratio_clip[turn]", "turn_mass_conserving"),
    ],
)
def test_ratio_objectives_reduce_to_reinforce_on_fresh_data(objective: str, reducer: str) -> None:
    # At ρ = 1 (π_beh = πθ) and weights constant within each ratio unit, every objective has
    # REINFORCE's gradient under the same reducer.
    policy = TinyPolicy(seed=3)

    def run(fn: Callable[..., ObjectiveOutput]) -> torch.Tensor:
        new = policy.logprobs()
        out = fn(
            new_logprobs_B_T=new,
            behavior_logprobs_B_T=new.detach(),
            advantages_B=policy.advantages,
            mask_B_T=MASK,
            turn_ids_B_T=TURNS,
            reducer=reducer,
        )
        return policy.grad(out.loss)

    got = run(_objective(objective))
    want = run(_objective("reinforce_with_kl"))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)


def _perturbed_inputs(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    new = torch.randn(B, T, generator=g, dtype=F64) - 2.0
    beh = new + 0.3 * torch.randn(B, T, generator=g, dtype=F64)  # many ratios outside ±20%
    ref = new + 0.5 * torch.randn(B, T, generator=g, dtype=F64)
    beh = torch.where(MASK > 0, beh, torch.nan)  # NaN padding off the mask must be harmless
    return {
        "new_logprobs_B_T": new.requires_grad_(True),
        "behavior_logprobs_B_T": beh,
        "ref_logprobs_B_T": ref,
        "advantages_B": torch.randn(B, generator=g, dtype=F64),
        "mask_B_T": MASK,
        "turn_ids_B_T": TURNS,
        "success_B": torch.tensor([True, False, True, False, False]),
    }


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("reducer", sorted(REDUCERS))
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_analytic_gradient_coefficients_match_autograd(
    objective: str, reducer: str, estimator: str
) -> None:
    inputs = _perturbed_inputs(seed=11)
    out = _objective(objective)(
        **inputs, reducer=reducer, kl_spec=KLSpec(estimator=estimator, beta=0.3)
    )
    (grad,) = torch.autograd.grad(out.loss, inputs["new_logprobs_B_T"])
    assert bool(torch.isfinite(grad).all())
    # the clipped branch must be exercised, or this check could not catch a wrong binding rule
    assert out.clip_frac_token is None or 0.0 < out.clip_frac_token < 1.0
    torch.testing.assert_close(out.grad_coef_B_T, grad, rtol=1e-9, atol=1e-12)
    assert out.grad_mass_total == pytest.approx(float(grad.abs().sum()), rel=1e-9)


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("reducer", ["token_mean", "turn_mean", "length_normalized"])
def test_micro_batches_with_full_batch_weights_sum_to_the_full_batch(
    objective: str, reducer: str
) -> None:
    # Gradient accumulation: each micro-batch gets its rows of the full batch's weights.
    policy = TinyPolicy(seed=4)
    g = torch.Generator().manual_seed(9)
    beh = (policy.logprobs() + 0.2 * torch.randn(B, T, generator=g, dtype=F64)).detach()
    full_w = reducer_weights(reducer, MASK, TURNS, torch.float64)

    def loss(rows: list[int], weights: torch.Tensor | None) -> ObjectiveOutput:
        return _objective(objective)(
            new_logprobs_B_T=policy.logprobs()[rows],
            behavior_logprobs_B_T=beh[rows],
            advantages_B=policy.advantages[rows],
            mask_B_T=MASK[rows],
            turn_ids_B_T=TURNS[rows],
            reducer=reducer,
            kl_spec=KLSpec(beta=0.1),
            ref_logprobs_B_T=beh[rows] - 0.1,
            weights_B_T=weights,
        )

    everything = list(range(B))
    want = policy.grad(loss(everything, None).loss)
    parts = [[0, 1], [2, 3], [4]]
    got = torch.stack([policy.grad(loss(rows, full_w[rows]).loss) for rows in parts]).sum(0)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    # without the full-batch weights the micro-batches normalize by their own counts
    naive = torch.stack([policy.grad(loss(rows, None).loss) for rows in parts]).sum(0)
    assert not torch.allclose(naive, want, rtol=1e-6, atol=1e-9)
    with pytest.raises(MaskError, match="off the mask"):
        loss(everything, torch.ones(B, T, dtype=F64))


def test_kl_in_loss_adds_beta_times_reduced_kl() -> None:
    inputs = _perturbed_inputs(seed=5)
    reinforce = _objective("reinforce_with_kl")
    plain = reinforce(**inputs, reducer="token_mean")
    with_kl = reinforce(**inputs, reducer="token_mean", kl_spec=KLSpec(estimator="k3", beta=0.02))
    assert plain.kl is not None and with_kl.kl is not None
    assert float(with_kl.loss.detach()) == pytest.approx(plain.pg_loss + 0.02 * with_kl.kl)
    # monitored but not in the loss when no spec is given (k3 by default)
    assert float(plain.loss.detach()) == pytest.approx(plain.pg_loss)
    assert plain.kl_token_mean == pytest.approx(with_kl.kl_token_mean)
    assert with_kl.kl_spec == KLSpec(estimator="k3", beta=0.02)
    with pytest.raises(LearnError, match="ref_logprobs"):
        reinforce(**{**inputs, "ref_logprobs_B_T": None}, kl_spec=KLSpec(beta=0.1))


def _hand_ratio_batch(
    ratios: list[list[float]], mask: list[list[int]], turns: list[list[int]], adv: list[float]
) -> dict[str, Any]:
    beh = torch.full((len(ratios), len(ratios[0])), -1.0, dtype=F64)
    new = (beh + torch.tensor(ratios, dtype=F64).log()).requires_grad_(True)
    return {
        "new_logprobs_B_T": new,
        "behavior_logprobs_B_T": beh,
        "advantages_B": torch.tensor(adv, dtype=F64),
        "mask_B_T": torch.tensor(mask),
        "turn_ids_B_T": torch.tensor(turns),
    }


def test_ppo_clip_fractions_on_hand_built_ratios() -> None:
    # ε = 0.2. A token is clipped when the clip binds (its gradient is zeroed):
    #   A > 0 and ρ > 1.2, or A < 0 and ρ < 0.8.
    # row 0 (A=+1): ρ = 1.0, 1.3*, 0.7, 1.1   turns 0,0,1,1  (0.7 is out of range but not binding)
    # row 1 (A=-1): ρ = 0.7*, 1.3, 1.0, pad   turns 0,1,1,-
    # row 2 (A=+1): ρ = 1, 1, pad, pad        turns 0,0,-,-
    # row 3: empty (not counted in the episode denominator)
    batch = _hand_ratio_batch(
        ratios=[[1.0, 1.3, 0.7, 1.1], [0.7, 1.3, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [1.0] * 4],
        mask=[[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]],
        turns=[[0, 0, 1, 1], [0, 1, 1, -1], [0, 0, -1, -1], [-1] * 4],
        adv=[1.0, -1.0, 1.0, 0.5],
    )
    out = ppo_clip(ObjectiveInputs(**batch), ClipRange(0.2))
    assert out.clip_frac_token == pytest.approx(2 / 9)  # 2 clipped of 9 action tokens
    assert out.clip_frac_turn == pytest.approx(2 / 5)  # (0,0) and (1,0) of 5 turns
    assert out.clip_frac_episode == pytest.approx(2 / 3)  # rows 0 and 1 of 3 non-empty rows
    assert out.n_empty_episodes == 1
    # a wider clip-high releases the A>0 token at 1.3 but keeps the A<0 token at 0.7
    wide = ppo_clip(ObjectiveInputs(**batch), ClipRange(0.2, eps_high=0.4))
    assert wide.clip_frac_token == pytest.approx(1 / 9)
    no_turns = ppo_clip(ObjectiveInputs(**{**batch, "turn_ids_B_T": None}), ClipRange(0.2))
    assert no_turns.clip_frac_turn is None


def test_normalized_ratio_clip_fractions_on_hand_built_ratios() -> None:
    # row 0 (A=+1): turn 0 ρ = 1.5, 1.5 -> s = 1.5 (clipped); turn 1 ρ = 1, 1 -> s = 1
    #               whole sequence: s = sqrt(1.5) = 1.2247 > 1.2 -> clipped
    # row 1 (A=+1): ρ = 1.5, 1/1.5 in one turn -> s = 1 in both granularities
    # row 2 (A=-1): turn 0 ρ = .5 -> s=.5 (clipped); turn 1 ρ = 1 -> s = 1; sequence s = .707
    batch = _hand_ratio_batch(
        ratios=[[1.5, 1.5, 1.0, 1.0], [1.5, 1 / 1.5, 1.0, 1.0], [0.5, 1.0, 1.0, 1.0]],
        mask=[[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]],
        turns=[[0, 0, 1, 1], [0, 0, -1, -1], [0, 1, -1, -1]],
        adv=[1.0, 1.0, -1.0],
    )
    turn = normalized_ratio_clip(ObjectiveInputs(**batch), "turn", ClipRange(0.2))
    assert turn.clip_frac_token == pytest.approx(3 / 8)  # (0,0) has 2 tokens, (2,0) has 1
    assert turn.clip_frac_turn == pytest.approx(2 / 5)
    assert turn.clip_frac_episode == pytest.approx(2 / 3)
    seq = normalized_ratio_clip(ObjectiveInputs(**batch), "sequence", ClipRange(0.2))
    assert seq.clip_frac_token == pytest.approx(6 / 8)  # rows 0 and 2: 4 + 2 tokens
    assert seq.clip_frac_turn == pytest.approx(4 / 5)
    assert seq.clip_frac_episode == pytest.approx(2 / 3)
    assert seq.objective == "normalized_ratio_clip[sequence]"
    with pytest.raises(MaskError, match="turn_ids"):
        normalized_ratio_clip(ObjectiveInputs(**{**batch, "turn_ids_B_T": None}), "turn")
    with pytest.raises(LearnError, match="granularity"):
        normalized_ratio_clip(ObjectiveInputs(**batch), "token")  # type: ignore[arg-type]


def test_reinforce_reports_unit_ratios_on_fresh_data_and_no_clipping() -> None:
    policy = TinyPolicy()
    new = policy.logprobs()
    out = reinforce_with_kl(ObjectiveInputs(
        new_logprobs_B_T=new,
        behavior_logprobs_B_T=new.detach(),
        advantages_B=policy.advantages,
        mask_B_T=MASK,
        entropy_B_T=token_entropy(policy.logits()),
    ))
    assert out.ratio_p50 == out.ratio_p95 == out.ratio_p99 == out.ratio_max == 1.0
    assert out.abs_log_ratio_mean == out.abs_log_ratio_p99 == out.abs_log_ratio_max == 0.0
    assert out.clip_frac_token is None and out.clip_frac_episode is None
    assert out.entropy is not None and 0.0 < out.entropy < torch.log(torch.tensor(7.0)).item()
    metrics = out.metrics()
    assert metrics["ratio/ratio_p99"] == 1.0 and metrics["clip/clip_frac_token"] is None
    assert metrics["batch/n_action_tokens"] == int(MASK.sum())


def test_ratio_tails_hand_worked() -> None:
    # |log ρ| = 0, 0.01, ..., 1.00 (101 values, alternating sign): the 0.99 quantile sits at
    # rank 0.99 · 100 = 99 exactly, so p99 = 0.99; mean = 0.5; max = 1.0; ρ_max = e^1.0.
    abs_log = torch.arange(101, dtype=F64) / 100
    log_ratio = torch.where(torch.arange(101) % 2 == 0, abs_log, -abs_log)
    stats = ratio_stats(log_ratio[torch.randperm(101, generator=torch.Generator().manual_seed(0))])
    assert stats["abs_log_ratio_p99"] == pytest.approx(0.99, abs=1e-12)
    assert stats["abs_log_ratio_mean"] == pytest.approx(0.5, abs=1e-12)
    assert stats["abs_log_ratio_max"] == 1.0
    assert stats["ratio_max"] == pytest.approx(torch.e)
    assert ratio_stats(torch.zeros(0, dtype=F64)) == dict.fromkeys(RATIO_KEYS)


def test_the_output_keeps_each_action_tokens_log_ratio() -> None:
    """``log_ratio_N`` is log πθ - log π_beh on the mask, row-major; its statistics are the
    output's ratio tails (the p99 of |log ρ| among them)."""
    policy = TinyPolicy()
    new = policy.logprobs()
    beh = new.detach() + 0.1 * torch.randn(B, T, generator=torch.Generator().manual_seed(1),
                                           dtype=F64)
    out = reinforce_with_kl(ObjectiveInputs(new_logprobs_B_T=new, behavior_logprobs_B_T=beh,
                                            advantages_B=policy.advantages, mask_B_T=MASK))
    expected = (new.detach() - beh)[MASK.bool()]
    torch.testing.assert_close(out.log_ratio_N, expected, rtol=0, atol=0)
    assert out.abs_log_ratio_p99 == float(torch.quantile(expected.abs(), 0.99))
    assert out.metrics()["ratio/abs_log_ratio_p99"] == out.abs_log_ratio_p99
    assert 0 < out.abs_log_ratio_mean < out.abs_log_ratio_p99 < out.abs_log_ratio_max


def test_gradient_mass_split_hand_worked() -> None:
    # episode_sum, A = [1, -1], T = [2, 4]: |c| = |A|/B = .5 per token -> masses 1 and 2.
    new = torch.zeros(2, 4, dtype=F64, requires_grad=True)
    kwargs: dict[str, Any] = {
        "new_logprobs_B_T": new,
        "behavior_logprobs_B_T": new.detach(),
        "advantages_B": torch.tensor([1.0, -1.0], dtype=F64),
        "mask_B_T": torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]),
        "success_B": torch.tensor([True, False]),
        "length_band_edges": (2, 3),  # short: T <= 2, medium: 2 < T <= 3, long: T > 3
    }
    reinforce = _objective("reinforce_with_kl")
    out = reinforce(**kwargs, reducer="episode_sum")
    assert out.grad_mass_total == pytest.approx(3.0)
    assert (out.grad_mass_success, out.grad_mass_failure) == pytest.approx((1 / 3, 2 / 3))
    assert (out.grad_mass_short, out.grad_mass_medium, out.grad_mass_long) == pytest.approx(
        (1 / 3, 0.0, 2 / 3)
    )
    # length_normalized gives each episode equal mass: .5 and .5
    norm = reinforce(**kwargs, reducer="length_normalized")
    assert (norm.grad_mass_success, norm.grad_mass_failure) == pytest.approx((0.5, 0.5))
    no_labels = reinforce(**{**kwargs, "success_B": None})
    assert no_labels.grad_mass_success is None


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_all_empty_mask_gives_zero_loss_and_none_metrics(objective: str) -> None:
    new = torch.full((2, 3), torch.nan, dtype=F64, requires_grad=True)
    out = _objective(objective)(
        new_logprobs_B_T=new,
        behavior_logprobs_B_T=torch.full((2, 3), torch.nan),
        advantages_B=torch.ones(2, dtype=F64),
        mask_B_T=torch.zeros(2, 3),
        turn_ids_B_T=torch.full((2, 3), -1),
    )
    (grad,) = torch.autograd.grad(out.loss, new)
    assert float(out.loss.detach()) == 0.0 and float(grad.abs().sum()) == 0.0
    assert out.ratio_p50 is None and out.grad_mass_short is None
    assert out.n_empty_episodes == 2 and out.n_action_tokens == 0


def test_input_validation() -> None:
    inputs = _perturbed_inputs(seed=2)
    bad_beh = inputs["behavior_logprobs_B_T"].clone()
    bad_beh[0, 1] = float("-inf")  # on the mask
    clipped = _objective("ppo_clip")
    with pytest.raises(NonFiniteLogprobError):
        clipped(**{**inputs, "behavior_logprobs_B_T": bad_beh})
    with pytest.raises(MaskError):
        clipped(**{**inputs, "advantages_B": torch.ones(B + 1)})
    with pytest.raises(UnknownNameError):
        clipped(**inputs, reducer="seq_mean_token_mean")
    with pytest.raises(LearnError):
        ClipRange(1.5)


def test_the_registry_names_each_objective_by_its_output_and_says_which_use_ratios() -> None:
    policy = TinyPolicy(seed=6)
    new = policy.logprobs()
    uses_ratio = {}
    for name in OBJECTIVES:
        objective = get_objective(name)
        out = objective(ObjectiveInputs(new_logprobs_B_T=new, behavior_logprobs_B_T=new.detach(),
                                        advantages_B=policy.advantages, mask_B_T=MASK,
                                        turn_ids_B_T=TURNS))
        assert out.objective == objective.name == name
        uses_ratio[name] = objective.uses_ratio
    assert uses_ratio == {"reinforce_with_kl": False, "ppo_clip": True,
                          "normalized_ratio_clip[sequence]": True,
                          "normalized_ratio_clip[turn]": True}
    with pytest.raises(UnknownObjectiveError, match="ppo_clip"):  # the known names are listed
        get_objective("ppo")


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_one_small_step_on_a_shared_parameter_batch_raises_the_surrogate_with_bounded_kl(
    objective: str,
) -> None:
    # Seed 000 §7: a shared-parameter batch need only raise the aggregate objective
    # Σ_i A_i Σ_t log π(a_it) with a bounded KL to the old policy (not every action's log-prob).
    policy = TinyPolicy(seed=8)

    def surrogate() -> tuple[float, torch.Tensor]:
        with torch.no_grad():
            value = float((policy.advantages * (policy.logprobs() * MASK).sum(1)).sum())
            return value, torch.log_softmax(policy.logits(), -1)

    before, old = surrogate()
    new = policy.logprobs()
    out = _objective(objective)(new_logprobs_B_T=new, behavior_logprobs_B_T=new.detach(),
                                advantages_B=policy.advantages, mask_B_T=MASK,
                                turn_ids_B_T=TURNS)
    params = list(policy.layer.parameters())
    grads = torch.autograd.grad(out.loss, params)
    with torch.no_grad():
        for p, g in zip(params, grads, strict=True):
            p -= 0.05 * g
    after, fresh = surrogate()
    kl = float((old.exp() * (old - fresh)).sum(-1)[MASK > 0].mean())  # KL(old || new) per token
    assert after > before
    assert 0 <= kl < 0.05


def test_decoupled_ppo_clip_weighs_by_prox_over_beh_and_clips_around_prox() -> None:
    """π_prox = π_beh gives ppo_clip itself; with π_prox ≠ π_beh the gradient of a token is
    -w · A · r · ∂log πθ (w = π_prox/π_beh capped, r = πθ/π_prox), and the clip binds on r."""
    beh = torch.log(torch.tensor([[0.5, 0.2, 0.4]]))
    prox = torch.log(torch.tensor([[0.6, 0.1, 0.4]]))  # w = 1.2, 0.5, 1.0
    new = torch.log(torch.tensor([[0.6, 0.2, 0.6]])).requires_grad_(True)  # r = 1, 2, 1.5
    base = dict(behavior_logprobs_B_T=beh, advantages_B=torch.tensor([1.0]),
                mask_B_T=torch.ones(1, 3))
    same = ppo_clip(ObjectiveInputs(new_logprobs_B_T=new, proximal_logprobs_B_T=beh, **base))
    plain = ppo_clip(ObjectiveInputs(new_logprobs_B_T=new, **base))
    assert float(same.loss.detach()) == pytest.approx(float(plain.loss.detach()))
    out = ppo_clip(ObjectiveInputs(new_logprobs_B_T=new, proximal_logprobs_B_T=prox,
                                   behavior_weight_cap=5.0, **base), ClipRange(0.2))
    (grad,) = torch.autograd.grad(out.loss, new)
    # token 0: w 1.2, r 1 -> -1.2; token 1: r 2 > 1.2 clipped -> 0; token 2: r 1.5 clipped -> 0
    assert grad[0].tolist() == pytest.approx([-1.2, 0.0, 0.0], abs=1e-6)
    capped = ppo_clip(ObjectiveInputs(new_logprobs_B_T=new, proximal_logprobs_B_T=prox,
                                      behavior_weight_cap=1.1, **base), ClipRange(0.2))
    (grad,) = torch.autograd.grad(capped.loss, new)
    assert grad[0, 0].item() == pytest.approx(-1.1)
