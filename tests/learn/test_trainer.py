"""The trainer on a tiny random Llama with LoRA: exact micro-batching, advantage sign, KL at 0,
batch reuse by ratio objectives."""

import copy
import dataclasses
import math

import pytest
import torch

from closedloop.contracts import Episode
from closedloop.engine import sequence_logprobs
from closedloop.learn.sft import supervised_warm_start
from closedloop.learn.trainer import BatchReuseError, Trainer, TrainerConfig
from closedloop.policy import build_tiny_model, load_embedded_tokenizer
from closedloop.policy.lora import adapter_is_inert, attach_lora
from closedloop.rollout.tensors import build_training_batch, shift_targets
from tests.factories import make_traj, make_turn


@pytest.fixture(scope="module")
def policy():
    tok = load_embedded_tokenizer()
    model = attach_lora(build_tiny_model(tok, seed=3, init_std=0.3), r=4, alpha=8, seed=0)
    # LoRA B starts at 0; give it a value so the adapter is not a no-op for gradient tests.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    return model


def episode(model, seed, n_turns=2, episode_id="e", first_prompt=None):
    """A random threaded episode whose behaviour log-probs are the model's own (on-policy).

    ``first_prompt`` fixes the turn-0 prompt ids (GRPO siblings share it).
    """
    g = torch.Generator().manual_seed(seed)
    turns, ctx = [], 0
    for k in range(n_turns):
        prompt = torch.randint(10, 5000, (5 if k == 0 else 3,), generator=g).tolist()
        if k == 0 and first_prompt is not None:
            prompt = list(first_prompt)
        action = torch.randint(10, 5000, (int(torch.randint(2, 6, (1,), generator=g)),),
                               generator=g).tolist()
        ctx += len(prompt)
        turns.append(make_turn(k, prompt=prompt, action=action, context_len=ctx,
                               episode_id=episode_id))
        ctx += len(action)
    ep = Episode(make_traj(num_turns=n_turns, episode_id=episode_id), tuple(turns))
    batch = build_training_batch([ep])
    with torch.no_grad():
        lps = sequence_logprobs(model, batch.token_ids_B_T, batch.attention_mask_B_T)[0]
    mask = shift_targets(batch).mask_B_T[0].bool()
    on = lps[mask].tolist()
    fixed, i = [], 0
    for t in turns:
        n = len(t.action_token_ids)
        fixed.append(make_turn(t.turn, prompt=t.prompt_token_ids, action=t.action_token_ids,
                               context_len=t.context_len_before, episode_id=episode_id,
                               behavior_logprobs=on[i:i + n], raw_model_logprobs=on[i:i + n]))
        i += n
    return Episode(ep.trajectory, tuple(fixed))


def gradient_only_step(policy, batch, adv, **config):
    """One ``Trainer.step`` that leaves the weights as they were (learning rate 0, no weight
    decay, no gradient clipping): the batch's gradient stays in ``.grad``; its metrics."""
    cfg = TrainerConfig(kl_beta=0.0, learning_rate=0.0, max_grad_norm=math.inf, **config)
    before = [p.detach().clone() for p in policy.parameters()]
    metrics = Trainer(policy, cfg).step(batch, adv).metrics
    assert all(torch.equal(a, p) for a, p in zip(before, policy.parameters(), strict=True))
    return metrics


@pytest.mark.parametrize("reducer", ["episode_sum", "token_mean", "length_normalized",
                                     "turn_mass_conserving"])
def test_micro_batching_is_exact(policy, reducer):
    eps = [episode(policy, s, n_turns=1 + s % 3, episode_id=f"e{s}") for s in range(5)]
    batch = build_training_batch(eps)
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0, 0.5])
    grads, losses = [], []
    for micro in (1, 2, 5):
        metrics = gradient_only_step(policy, batch, adv, reducer=reducer,
                                     micro_batch_size=micro)
        losses.append(metrics["losses/loss"])
        grads.append({n: p.grad.clone() for n, p in policy.named_parameters()
                      if p.requires_grad})
    scale = max(float(g.abs().max()) for g in grads[0].values())
    assert scale > 1e-6
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert losses[2] == pytest.approx(losses[0], rel=1e-5)
    for name in grads[0]:
        for other in grads[1:]:
            # fp32 summation order differs between chunkings (~1e-7 relative); a mis-normalized
            # micro-batch would be off by a factor of 2-5 of the gradient itself.
            torch.testing.assert_close(other[name], grads[0][name], rtol=1e-4,
                                       atol=1e-4 * scale)


def _off_policy(ep, shift):
    """``ep`` with its behaviour log-probs lowered by ``shift(k)`` on its k-th action token."""
    turns, k = [], 0
    for t in ep.turns:
        beh = [lp - shift(k + i) for i, lp in enumerate(t.behavior_logprobs)]
        k += len(beh)
        turns.append(dataclasses.replace(t, behavior_logprobs=beh, raw_model_logprobs=beh))
    return Episode(ep.trajectory, tuple(turns))


def test_the_step_ratio_tails_are_exact_across_micro_batches(policy):
    """p99, max and mean of |log πθ/π_beh| for the step are those of all its action tokens at
    once, whatever the micro-batch size; an average of micro-batch p99s is not."""
    # Episode 0 carries a 1-nat tail on its first token; the others small distinct shifts.
    eps = [_off_policy(episode(policy, s, n_turns=1 + s % 3, episode_id=f"q{s}"),
                       (lambda k, s=s: 1.0 if s == 0 and k == 0 else 0.01 * (s + 1) + 1e-3 * k))
           for s in range(5)]
    batch = build_training_batch(eps)
    shifted = shift_targets(batch)
    with torch.no_grad():
        new = sequence_logprobs(policy, batch.token_ids_B_T, batch.attention_mask_B_T)
    on = shifted.mask_B_T.bool()
    abs_log = (new[on].double() - shifted.behavior_logprobs_B_T[on].double()).abs()
    whole = {"p99": float(torch.quantile(abs_log, 0.99)), "max": float(abs_log.max()),
             "mean": float(abs_log.mean())}
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0, 0.5])
    for micro in (1, 2, 5):
        metrics = gradient_only_step(policy, batch, adv, micro_batch_size=micro)
        assert metrics["batch/micro_batches"] == -(-5 // micro)
        for stat, value in whole.items():
            # fp32 forward vs the trainer's path: ~1e-6 nat; the statistics differ by > 1e-2
            assert metrics[f"ratio/abs_log_ratio_{stat}"] == pytest.approx(value, abs=1e-5)
    per_episode = [float(torch.quantile(abs_log[on.nonzero()[:, 0] == i], 0.99)) for i in range(5)]
    assert abs(sum(per_episode) / 5 - whole["p99"]) > 0.1  # what averaging would have logged


@pytest.mark.parametrize("objective", ["reinforce_with_kl", "ppo_clip"])
def test_shared_prompt_prefix_step_equals_the_unshared_step(policy, objective):
    # 3 groups x 3 siblings with prompts of 7, 11 and 9 ids; micro-batches of 4 split groups
    # (rows 0-3, 4-7, 8), so each micro-batch must dedupe its own rows.
    g = torch.Generator().manual_seed(0)
    eps = []
    for gi, plen in enumerate((7, 11, 9)):
        prompt = torch.randint(10, 5000, (plen,), generator=g).tolist()
        eps += [episode(policy, 10 * gi + k, n_turns=1 + k % 2, episode_id=f"g{gi}e{k}",
                        first_prompt=prompt) for k in range(3)]
    batch = build_training_batch(eps)
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0, 0.5, 0.75, -0.25, 1.5, -1.5])
    results, weights, grads, calls = [], [], [], []
    for share in (False, True):
        model = copy.deepcopy(policy)
        cfg = TrainerConfig(objective=objective, micro_batch_size=4, kl_beta=0.05,
                            learning_rate=1e-3, share_prompt_prefix=share)
        trainer = Trainer(model, cfg, reference=model.disable_adapter)
        trainer.step(batch, adv)  # a first step so that π_θ != π_ref and the ratio moves
        decoder = model.get_base_model().get_decoder()
        handle = decoder.register_forward_pre_hook(lambda *_, s=share: calls.append(s))
        results.append(trainer.step(batch, adv))
        handle.remove()
        trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        weights.append({n: p.detach().clone() for n, p in trained})
        grads.append({n: p.grad.clone() for n, p in trained})
    (off, on), (w_off, w_on), (g_off, g_on) = results, weights, grads
    # 3 micro-batches x (π_θ, π_ref) x one pass (shared: one packed call over unpadded tokens)
    assert (calls.count(False), calls.count(True)) == (6, 6)
    assert off.metrics["losses/kl"] > 1e-6
    assert on.grad_norm == pytest.approx(off.grad_norm, rel=1e-5)
    for key in ("losses/loss", "losses/kl", "losses/pg_loss"):
        assert on.metrics[key] == pytest.approx(off.metrics[key], rel=1e-5, abs=1e-7)
    scale = max(float(g.abs().max()) for g in g_off.values())
    for name in w_off:
        torch.testing.assert_close(g_on[name], g_off[name], rtol=1e-4, atol=1e-5 * scale)
        # Adam moves each weight by about lr whatever the gradient's size, so a component whose
        # gradient is near Adam's eps can differ by more than its share of fp noise: 1e-3 lr.
        torch.testing.assert_close(w_on[name], w_off[name], rtol=0, atol=1e-6)


def _trained(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("objective", ["ppo_clip", "normalized_ratio_clip[sequence]"])
def test_a_ratio_objective_takes_several_optimizer_steps_on_one_batch(policy, objective):
    """optimizer_steps_per_batch=3: three optimizer steps, each re-scoring πθ against the
    recorded π_beh, so the ratio is 1 on the first pass only; the weights equal those of three
    one-step calls on the same batch, and differ from one step's."""
    eps = [episode(policy, s, n_turns=1 + s % 2, episode_id=f"r{s}") for s in range(3)]
    batch = build_training_batch(eps)
    adv = torch.tensor([1.0, -1.0, 0.5])
    weights = []
    for steps, calls in ((3, 1), (1, 3), (1, 1)):
        model = copy.deepcopy(policy)
        cfg = TrainerConfig(objective=objective, learning_rate=5e-3, kl_beta=0.05,
                            optimizer_steps_per_batch=steps)
        trainer = Trainer(model, cfg, reference=model.disable_adapter)
        for _ in range(calls):
            result = trainer.step(batch, adv)
        assert len(result.passes) == steps == result.metrics["optim/steps_on_batch"]
        assert trainer.step_count == calls  # fresh batches consumed, not optimizer steps
        if steps == 3:
            drift = [m["ratio/abs_log_ratio_max"] for m in result.passes]
            assert drift[0] < 1e-4 < drift[1] and drift[2] > 1e-4, drift
            assert result.metrics["ratio/abs_log_ratio_max"] == drift[0]
            # every pass's tails and clip fractions are logged, not only the first's
            logged = [result.metrics[f"pass{k}/ratio/abs_log_ratio_max"] for k in range(3)]
            assert logged == drift
            for k in range(3):
                for key in ("clip/clip_frac_token", "clip/clip_frac_episode",
                            "ratio/abs_log_ratio_p99", "grad_mass/grad_mass_clipped_pos"):
                    assert result.metrics[f"pass{k}/{key}"] == result.passes[k][key]
            assert "pass3/ratio/abs_log_ratio_max" not in result.metrics
            assert result.metrics["pass0/grad_mass/grad_mass_clipped_neg"] == 0.0  # ρ = 1
        weights.append(_trained(model))
    reused, repeated, once = weights
    for name in reused:
        torch.testing.assert_close(reused[name], repeated[name], rtol=0, atol=1e-6)
    assert max(float((reused[n] - once[n]).abs().max()) for n in once) > 1e-3


def test_a_ratio_free_objective_refuses_to_reuse_a_batch(policy):
    with pytest.raises(BatchReuseError, match="reinforce_with_kl"):
        Trainer(copy.deepcopy(policy), TrainerConfig(optimizer_steps_per_batch=2))
    with pytest.raises(BatchReuseError):
        Trainer(copy.deepcopy(policy), TrainerConfig(objective="ppo_clip",
                                                     optimizer_steps_per_batch=0))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_advantage_sign_moves_the_episode_logprob(policy, sign):
    ep = episode(policy, 11)
    batch = build_training_batch([ep])
    mask = shift_targets(batch).mask_B_T

    def total_logprob(model):
        with torch.no_grad():
            return float((sequence_logprobs(model, batch.token_ids_B_T,
                                            batch.attention_mask_B_T) * mask).sum())

    model = copy.deepcopy(policy)
    before = total_logprob(model)
    Trainer(model, TrainerConfig(learning_rate=1e-3, kl_beta=0.0)).step(
        batch, torch.tensor([sign]))
    after = total_logprob(model)
    assert (after - before) * sign > 0


def test_kl_to_the_adapter_free_reference_starts_at_zero():
    tok = load_embedded_tokenizer()
    model = attach_lora(build_tiny_model(tok, seed=4), r=4, alpha=8)
    ep = episode(model, 5)
    trainer = Trainer(model, TrainerConfig(kl_beta=0.1), reference=model.disable_adapter)
    result = trainer.step(build_training_batch([ep]), torch.tensor([1.0]))
    assert result.metrics["losses/kl"] == pytest.approx(0.0, abs=1e-6)
    assert result.metrics["ratio/ratio_p50"] == pytest.approx(1.0, abs=1e-4)
    result = trainer.step(build_training_batch([ep]), torch.tensor([1.0]))
    assert result.metrics["losses/kl"] > 0


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_sft_lowers_the_demonstration_nll(policy, precision):
    model = copy.deepcopy(policy)
    demos = [episode(model, s, episode_id=f"d{s}") for s in range(4)]
    result = supervised_warm_start(model, demos, pad_id=0, epochs=3, batch_size=2,
                                   learning_rate=5e-3, seed=0, precision=precision)
    assert result.optimizer_steps == 6
    assert result.trained_action_tokens == 3 * sum(
        len(t.action_token_ids) for d in demos for t in d.turns)
    assert result.losses[-1] < result.losses[0]


def test_sft_micro_batches_add_up_to_the_whole_batch_gradient(policy):
    """The warm start's micro-batch size sets memory, not the gradient: one episode at a time,
    the default and the whole batch at once give the same loss and gradient (float32
    summation order apart)."""
    from closedloop.learn.sft import SFT_MICRO_BATCH, sft_backward

    demos = [episode(policy, s, n_turns=1 + s % 3, episode_id=f"m{s}") for s in range(5)]
    grads = []
    for micro in (1, SFT_MICRO_BATCH, len(demos)):
        model = copy.deepcopy(policy)
        loss, n = sft_backward(model, demos, 0, micro)
        grads.append((loss, n, torch.cat([p.grad.flatten() for p in model.parameters()
                                          if p.requires_grad])))
    (loss0, n0, g0) = grads[-1]
    for loss, n, g in grads[:-1]:
        assert n == n0 and loss == pytest.approx(loss0, rel=1e-5)
        # each entry sums hundreds of per-token terms, each micro-batch in its own order:
        # ~10^3 float32 ulps of the largest entry (2e-6 of 0.46 measured)
        assert float((g - g0).abs().max()) <= 1e-4 * float(g0.abs().max())


def test_a_clip_removes_mass_by_advantage_sign_and_credit_length_correlates(policy):
    """At ρ far above 1 + ε a positive advantage is clipped (its mass counted under A > 0) and
    a negative one is not; below 1 − ε the other way round; the advantage-length correlation
    is Pearson's over the episodes."""
    from closedloop.learn.trainer import advantage_length_correlation

    eps = [episode(policy, s, n_turns=1 + s % 2, episode_id=f"c{s}") for s in range(3)]
    batch = build_training_batch(eps)
    shifted = shift_targets(batch)
    inflated = dataclasses.replace(batch, behavior_logprobs_B_T=batch.behavior_logprobs_B_T - 1.0)
    model = copy.deepcopy(policy)
    trainer = Trainer(model, TrainerConfig(objective="ppo_clip", learning_rate=0.0,
                                           kl_beta=0.0))
    m = trainer.step(inflated, torch.tensor([1.0, -1.0, 1.0])).metrics
    assert m["grad_mass/grad_mass_clipped_pos"] > 0 and m["grad_mass/grad_mass_clipped_neg"] == 0
    deflated = dataclasses.replace(batch, behavior_logprobs_B_T=batch.behavior_logprobs_B_T + 1.0)
    m = trainer.step(deflated, torch.tensor([-1.0, 1.0, -1.0])).metrics
    assert m["grad_mass/grad_mass_clipped_neg"] > 0 and m["grad_mass/grad_mass_clipped_pos"] == 0
    lengths = shifted.mask_B_T.sum(dim=1)
    assert m["credit/adv_len_corr"] == advantage_length_correlation(
        torch.tensor([-1.0, 1.0, -1.0]), lengths)
    n = torch.tensor([3, 5, 9, 4])
    assert advantage_length_correlation(2.0 * n - 1, n) == pytest.approx(1.0)
    assert advantage_length_correlation(-n.double(), n) == pytest.approx(-1.0)
    # hand-worked: A = (1, -1, 1, -1), n̄ = 5.25: Σ A (n - n̄) = 3, Σ A² = 4,
    # Σ (n - n̄)² = 20.75, so r = 3 / sqrt(4 · 20.75) = 3 / sqrt(83)
    assert advantage_length_correlation(torch.tensor([1.0, -1, 1, -1]), n) == pytest.approx(
        3 / 83 ** 0.5, rel=1e-9)
    assert advantage_length_correlation(torch.ones(4), n) is None


def test_a_token_budget_cuts_the_last_sft_batch_to_the_nearest_episode(policy):
    """The SFT-only control matches the RL arm's trained action tokens: the batch that reaches
    the budget is cut to the prefix of episodes nearest it, never a whole batch past it."""
    from closedloop.learn.sft import action_tokens, fit_to_budget

    eps = [episode(policy, s, n_turns=2, episode_id=f"b{s}") for s in range(6)]
    sizes = [action_tokens(e) for e in eps]
    cut, last = fit_to_budget(eps, sizes[0] + sizes[1] // 3)
    assert len(cut) == 1 and last  # nearer to one episode than to two
    cut, last = fit_to_budget(eps, sum(sizes) + 50)
    assert len(cut) == 6 and not last  # the whole batch is still short of the budget
    budget = sizes[0] + sizes[1] + sizes[2] // 2 + 1
    result = supervised_warm_start(copy.deepcopy(policy), eps, 0, epochs=3, batch_size=6,
                                   learning_rate=1e-3, seed=0, max_tokens=budget)
    assert abs(result.trained_action_tokens - budget) <= max(sizes) // 2 + 1
    assert result.optimizer_steps == 1


def test_a_fresh_adapter_is_inert_and_a_trained_one_is_not():
    tok = load_embedded_tokenizer()
    base = build_tiny_model(tok, seed=4)
    assert not adapter_is_inert(base)  # no adapter at all
    model = attach_lora(base, r=4, alpha=8)
    assert adapter_is_inert(model)
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n)[0, 0] = 1e-30
    assert not adapter_is_inert(model)


def test_a_dora_adapter_is_never_inert():
    from peft import LoraConfig, get_peft_model

    tok = load_embedded_tokenizer()
    model = get_peft_model(build_tiny_model(tok, seed=4), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True, task_type="CAUSAL_LM"))
    assert not adapter_is_inert(model)  # the magnitude renormalizes: not the base bit for bit


def test_the_reference_of_an_inert_adapter_is_the_policy_without_its_forward():
    """While the adapter adds nothing, π_ref's log-probs are πθ's (not a second forward) and
    the step is bit for bit the step that scored π_ref under ``disable_adapter``; after the
    step the reference is scored again."""
    tok = load_embedded_tokenizer()
    model = attach_lora(build_tiny_model(tok, seed=4, init_std=0.3), r=4, alpha=8)
    twin = copy.deepcopy(model)
    batch = build_training_batch([episode(model, s, episode_id=f"e{s}") for s in range(3)])
    adv = torch.tensor([1.0, -0.5, 0.25])
    entered = []

    def counted():
        entered.append(1)
        return model.disable_adapter()

    cfg = TrainerConfig(kl_beta=0.1, learning_rate=1e-2, micro_batch_size=2)
    fast = Trainer(model, cfg, reference=counted,
                   reference_is_policy=lambda: adapter_is_inert(model))
    slow = Trainer(twin, cfg, reference=twin.disable_adapter)
    got, want = fast.step(batch, adv), slow.step(batch, adv)
    assert entered == []
    assert got.metrics["losses/loss"] == want.metrics["losses/loss"]
    assert got.metrics["losses/kl"] == want.metrics["losses/kl"]
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
    fast.step(batch, adv)
    assert len(entered) == 2  # one micro-batch of 2 rows, one of 1: scored under the base
