"""The trainer on a tiny random Llama with LoRA: exact micro-batching, advantage sign, KL at 0."""

import copy

import pytest
import torch

from closedloop.contracts import Episode
from closedloop.learn.sft import supervised_warm_start
from closedloop.learn.trainer import Trainer, TrainerConfig
from closedloop.policy import build_tiny_model, load_embedded_tokenizer
from closedloop.policy.logprobs import sequence_logprobs
from closedloop.policy.lora import attach_lora
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


def episode(model, seed, n_turns=2, episode_id="e"):
    """A random threaded episode whose behaviour log-probs are the model's own (on-policy)."""
    g = torch.Generator().manual_seed(seed)
    turns, ctx = [], 0
    for k in range(n_turns):
        prompt = torch.randint(10, 5000, (5 if k == 0 else 3,), generator=g).tolist()
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


@pytest.mark.parametrize("reducer", ["episode_sum", "token_mean", "length_normalized",
                                     "turn_mass_conserving"])
def test_micro_batching_is_exact(policy, reducer):
    eps = [episode(policy, s, n_turns=1 + s % 3, episode_id=f"e{s}") for s in range(5)]
    batch = build_training_batch(eps)
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0, 0.5])
    grads, losses = [], []
    for micro in (1, 2, 5):
        cfg = TrainerConfig(reducer=reducer, micro_batch_size=micro, kl_beta=0.0)
        metrics, _, _ = Trainer(policy, cfg).accumulate_gradients(batch, adv)
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


def test_sft_lowers_the_demonstration_nll(policy):
    model = copy.deepcopy(policy)
    demos = [episode(model, s, episode_id=f"d{s}") for s in range(4)]
    result = supervised_warm_start(model, demos, pad_id=0, epochs=3, batch_size=2,
                                   learning_rate=5e-3, seed=0)
    assert result.optimizer_steps == 6
    assert result.trained_action_tokens == 3 * sum(
        len(t.action_token_ids) for d in demos for t in d.turns)
    assert result.losses[-1] < result.losses[0]
