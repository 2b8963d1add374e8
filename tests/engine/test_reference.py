"""The fast paths equal the plain transformers reference (``closedloop.engine.transformers_path``).

Scoring: ``sequence_logprobs`` and ``trainer_path_logprobs`` (prompts shared or not) against
``reference_logprobs`` (full logits, log-softmax of ``z / τ``, gather). Generation:
``HFGenerator`` (lean Llama copy, module copy, the policy module itself; KV caches reused over
turns) against ``reference_generate`` (the whole context re-run at every step), drawing from
equally seeded ``torch.Generator``s.

Tolerance (``fp32_tolerance``), from the arithmetic rather than from one host's numbers: both
sides compute the same real function in float32 with different summation orders. A sum of
``n`` terms in any order is off by at most ``γ_n · Σ|terms|`` with ``γ_n = n·u / (1 - n·u)``,
``u = 2^-24`` (Higham, Accuracy and Stability of Numerical Algorithms, §3.1). A Llama block
makes 5 sequential reductions (attention scores, attention mix, output projection, gate/up,
down) and the head one more, so a logit is off by at most ``(5·L + 1) · γ_n · S``, taking ``n``
the longest reduction (hidden, intermediate or sequence length) and ``S`` the largest |logit|
as the scale of its terms (the normalized hidden states keep each layer's terms at that scale).
A log-softmax moves by at most twice the largest logit change, over ``τ``:
``tol = 2 · (5·L + 1) · γ_n · S / τ``. On the peaked tiny model (|z| ≈ 13, n ≈ 150) that is
~1e-2 at τ = 0.7, well under the gaps the mutation checks below must see (> 0.1).
"""

from __future__ import annotations

import pytest
import torch

from closedloop.contracts import SamplerConfig
from closedloop.engine import (
    HFGenerator,
    reference_generate,
    reference_logprobs,
    sequence_logprobs,
    trainer_path_logprobs,
)
from closedloop.policy import StopMatcher
from tests.engine.test_decode_copy import _perturb_lora
from tests.engine.test_prefix_logprobs import grouped_rows, lora_model

U = 2.0 ** -24  # float32 unit roundoff
SAMPLERS = {"nucleus": SamplerConfig(temperature=0.7, top_p=0.9),
            "top_k": SamplerConfig(temperature=1.3, top_k=20),
            "greedy": SamplerConfig(greedy=True)}


def fp32_tolerance(model, scale: float, length: int, temperature: float = 1.0) -> float:
    """``2 · (5·L + 1) · γ_n · S / τ`` (module doc)."""
    cfg = model.config
    n = max(cfg.hidden_size, cfg.intermediate_size, length)
    gamma = n * U / (1 - n * U)
    return 2 * (5 * cfg.num_hidden_layers + 1) * gamma * scale / temperature


def logit_scale(model, ids_B_T, mask_B_T=None) -> float:
    with torch.no_grad():
        return float(model(input_ids=ids_B_T, attention_mask=mask_B_T).logits.abs().max())


@pytest.fixture(scope="module")
def model(tokenizer):
    return lora_model(tokenizer)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_scoring_paths_equal_the_reference(model, temperature):
    ids, mask, target, _ = grouped_rows(seed=5)
    with torch.no_grad():
        want = reference_logprobs(model, ids, mask, target, temperature=temperature)
        paths = {
            "sequence": sequence_logprobs(model, ids, mask, target, temperature=temperature),
            "shared": trainer_path_logprobs(model, ids, mask, target, True, temperature),
            "unshared": trainer_path_logprobs(model, ids, mask, target, False, temperature),
        }
        other_tau = reference_logprobs(model, ids, mask, target, temperature=temperature + 0.3)
    tol = fp32_tolerance(model, logit_scale(model, ids, mask), ids.shape[1], temperature)
    for name, got in paths.items():
        assert float((got - want).abs().max()) <= tol, name
        assert bool((got[target == 0] == 0).all()), name
    assert int((want != 0).sum()) == int(target.sum())
    # the tolerance can fail: another temperature, or targets one position late, are far off
    assert float((other_tau - want).abs().max()) > 10 * tol
    late = torch.zeros_like(target)
    late[:, 1:] = target[:, :-1]
    with torch.no_grad():
        shifted = reference_logprobs(model, ids, mask, late, temperature=temperature)
    assert float((shifted[:, 1:] - want[:, :-1]).abs().max()) > 10 * tol


def test_left_padding_scores_as_the_reference(model):
    g = torch.Generator().manual_seed(6)
    a, b = torch.randint(10, 5000, (9,), generator=g), torch.randint(10, 5000, (5,), generator=g)
    ids = torch.stack([a, torch.cat([torch.zeros(4, dtype=torch.long), b])])
    mask = torch.tensor([[1] * 9, [0] * 4 + [1] * 5])
    with torch.no_grad():
        want = reference_logprobs(model, ids, mask)
        got = sequence_logprobs(model, ids, mask)
        alone = reference_logprobs(model, b[None])
    tol = fp32_tolerance(model, logit_scale(model, ids, mask), ids.shape[1])
    assert float((got - want).abs().max()) <= tol
    assert float((want[1, 4:] - alone[0]).abs().max()) <= tol  # padding is invisible
    assert bool((want[1, :4] == 0).all())


def _generators(model, tokenizer):
    return {"lean": HFGenerator(model, tokenizer, seed=0),
            "module": HFGenerator(model, tokenizer, seed=0, lean_decode=False),
            "policy": HFGenerator(model, tokenizer, seed=0, decode_copy=False)}


@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_generation_equals_the_reference_over_turns(tokenizer, renderer, sampler):
    model = lora_model(tokenizer)
    _perturb_lora(model, seed=4)
    config = SAMPLERS[sampler]
    for name, gen in _generators(model, tokenizer).items():
        matcher = StopMatcher(tokenizer, renderer.stop_sequences, gen.stop_token_ids)
        sid = gen.open_session(renderer.render_prompt("Repair a.json"))
        for turn, budget in enumerate((7, 10, 5)):
            context = gen.context(sid)
            (got,) = gen.generate_batch([sid], config, renderer.stop_sequences, budget,
                                        torch.Generator().manual_seed(turn))
            want = reference_generate(model, context, config, budget,
                                      torch.Generator().manual_seed(turn), matcher)
            assert got.action_token_ids == want.action_token_ids, (name, turn)
            assert got.finish_reason == want.finish_reason, (name, turn)
            full = torch.tensor([gen.context(sid)])
            scale, length = logit_scale(model, full), full.shape[1]
            tau = 1.0 if config.greedy else config.temperature
            raw_tol = fp32_tolerance(model, scale, length)
            beh_tol = fp32_tolerance(model, scale, length, tau)
            assert max(abs(x - y) for x, y in zip(got.raw_model_logprobs,
                                                  want.raw_model_logprobs, strict=True)) <= raw_tol
            assert max(abs(x - y) for x, y in zip(got.behavior_logprobs,
                                                  want.behavior_logprobs, strict=True)) <= beh_tol
            gen.extend(sid, renderer.render_observation(
                f"observation {turn}", turn_closed=renderer.turn_closed(got.action_token_ids)))


def test_the_generation_check_can_fail(tokenizer, renderer):
    # A generator that samples stale weights is caught: same seeds, different ids or log-probs.
    model = lora_model(tokenizer)
    gen = HFGenerator(model, tokenizer, seed=0)
    _perturb_lora(model, seed=9, scale=0.5)  # not published: the generator keeps the old copy
    prompt = renderer.render_prompt("Repair a.json")
    matcher = StopMatcher(tokenizer, renderer.stop_sequences, gen.stop_token_ids)
    got = gen.generate(prompt, SAMPLERS["greedy"], renderer.stop_sequences, 8, seed=0)
    want = reference_generate(model, prompt, SAMPLERS["greedy"], 8, torch.Generator(), matcher)
    tol = fp32_tolerance(model, logit_scale(model, torch.tensor([prompt])), len(prompt) + 8)
    assert got.action_token_ids != want.action_token_ids or max(
        abs(x - y) for x, y in zip(got.raw_model_logprobs, want.raw_model_logprobs,
                                   strict=False)) > 10 * tol
