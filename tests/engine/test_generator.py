"""HF generator: stops, KV reuse == re-prefill, trainer-path recompute, behaviour log-probs."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from closedloop.contracts import SamplerConfig
from closedloop.engine import HFGenerator, LogprobInputError, sequence_logprobs
from closedloop.policy import ContextOverflowError, GenerationError, Generator, StopMatcher
from closedloop.policy.chat import ChatMessage
from tests.policy.test_sampling import reference_logprobs

NUCLEUS = SamplerConfig(temperature=0.7, top_p=0.9)
GREEDY = SamplerConfig(greedy=True)


def run_episodes(gen, renderer, tasks, sampler, budgets=(6, 9, 12), seed=0):
    """Threaded multi-turn rollout: prompt, then (action, observation delta) per turn.

    Returns the sessions and, per row, a list of (action start position, Generation)."""
    sids = gen.open_sessions([renderer.render_prompt(t) for t in tasks])
    rng = torch.Generator().manual_seed(seed)
    records = [[] for _ in tasks]
    for turn, budget in enumerate(budgets):
        starts = [len(gen.context(s)) for s in sids]
        outs = gen.generate_batch(sids, sampler, renderer.stop_sequences, budget, rng)
        for i, (sid, g) in enumerate(zip(sids, outs, strict=True)):
            records[i].append((starts[i], g))
            obs = f"observation {turn} for {tasks[i][:9]}: " + "x>" * (len(tasks[i]) % 7 + turn)
            gen.extend(sid, renderer.render_observation(
                obs, turn_closed=renderer.turn_closed(g.action_token_ids)))
    return sids, records


def right_padded(contexts):
    t = max(map(len, contexts))
    ids = torch.tensor([c + [0] * (t - len(c)) for c in contexts])
    mask = torch.tensor([[1] * len(c) + [0] * (t - len(c)) for c in contexts])
    return ids, mask


# ---------------------------------------------------------------- stop detection
def test_stop_matcher_on_any_split_of_the_stop_sequence(tokenizer, renderer):
    m = StopMatcher(tokenizer, ["</tool_call>"], renderer.stop_token_ids)
    canonical = renderer.encode('{"name": "finish"}</tool_call>')
    odd = [i for piece in ['{"name": "finish"}', "</t", "ool", "_ca", "ll", ">"]
           for i in renderer.encode(piece)]
    for ids in (canonical, odd):
        assert [m.check(ids[:n]) for n in range(1, len(ids))] == [None] * (len(ids) - 1)
        assert m.check(ids) == "stop"
    assert m.check([*canonical[:-1], renderer.im_end_id]) == "eos"
    assert m.check(renderer.encode("</tool_call")) is None
    with pytest.raises(GenerationError):
        StopMatcher(tokenizer, [""], [])


def test_generation_stops_at_first_stop_sequence_and_eos(tiny_model, tokenizer, renderer):
    gen = HFGenerator(tiny_model, tokenizer)
    prompt = renderer.render_prompt("Repair a.json")
    free = gen.generate(prompt, GREEDY, [], 12, seed=0)
    assert free.finish_reason == "length" and len(free.action_token_ids) == 12
    stop = tokenizer.decode(free.action_token_ids[3:5])
    stopped = gen.generate(prompt, GREEDY, [stop], 12, seed=0)
    n = len(stopped.action_token_ids)
    assert stopped.finish_reason == "stop" and n <= 5
    assert stopped.action_token_ids == free.action_token_ids[:n]
    assert stop in tokenizer.decode(stopped.action_token_ids)
    assert stop not in tokenizer.decode(stopped.action_token_ids[:-1])
    eos_gen = HFGenerator(tiny_model, tokenizer, stop_token_ids=[free.action_token_ids[2]])
    first = free.action_token_ids.index(free.action_token_ids[2]) + 1
    ended = eos_gen.generate(prompt, GREEDY, [], 12, seed=0)
    assert ended.finish_reason == "eos" and ended.action_token_ids == free.action_token_ids[:first]


# ---------------------------------------------------------------- KV reuse
def test_kv_reuse_equals_reprefill(tiny_model, tokenizer, renderer):
    tasks = ["Repair a.json", "Repair a.json", "Fix the CLI flags in tool.py", "b"]
    reuse = HFGenerator(tiny_model, tokenizer)
    full = HFGenerator(tiny_model, tokenizer, reprefill=True)
    _, rec_a = run_episodes(reuse, renderer, tasks, NUCLEUS)
    _, rec_b = run_episodes(full, renderer, tasks, NUCLEUS)
    worst = 0.0
    for row_a, row_b in zip(rec_a, rec_b, strict=True):
        for (start_a, a), (start_b, b) in zip(row_a, row_b, strict=True):
            assert start_a == start_b and a.action_token_ids == b.action_token_ids
            for x, y in ((a.raw_model_logprobs, b.raw_model_logprobs),
                         (a.behavior_logprobs, b.behavior_logprobs)):
                worst = max(worst, float(np.abs(np.subtract(x, y)).max()))
    assert worst < 1e-4
    # reuse prefills only new ids; identical turn-0 prompts (rows 0, 1) are prefilled once
    assert reuse.stats.prefill_tokens < full.stats.prefill_tokens / 2
    assert reuse.stats.decode_tokens == full.stats.decode_tokens


def test_growing_kv_layer_equals_concatenation():
    from closedloop.engine.kv_cache import GrowingKVLayer

    layer, ks, vs = GrowingKVLayer(reserve=0), [], []
    gen = torch.Generator().manual_seed(0)
    for q in (5, 1, 1, 70, 1, 200, 3):
        k, v = torch.randn(2, 3, q, 4, generator=gen), torch.randn(2, 3, q, 4, generator=gen)
        ks.append(k)
        vs.append(v)
        got_k, got_v = layer.update(k, v)
        assert torch.equal(got_k, torch.cat(ks, 2)) and torch.equal(got_v, torch.cat(vs, 2))
    layer.batch_select_indices(torch.tensor([1]))
    assert torch.equal(layer.keys, torch.cat(ks, 2)[1:]) and layer.get_seq_length() == 281
    k, v = torch.ones(1, 3, 1, 4), torch.zeros(1, 3, 1, 4)
    assert torch.equal(layer.update(k, v)[0][:, :, -1:], k)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=40).filter(any))
def test_compaction_order_keeps_the_live_rows_and_moves_only_from_above(alive):
    from closedloop.engine.hf_generator import compaction_order

    order = compaction_order(alive)
    n = sum(alive)
    assert sorted(order) == [j for j, a in enumerate(alive) if a]  # each live row once
    assert all(i == j or i >= n for j, i in enumerate(order))  # in place where it stays
    assert sum(i != j for j, i in enumerate(order)) == sum(not a for a in alive[:n])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=12).filter(any), st.booleans(),
       st.integers(0, 2**16))
def test_growing_kv_layer_selection_equals_a_gather(alive, shuffle, seed):
    # In-place compaction (compaction_order: few rows move) and a shuffled order (rows move
    # onto slots that other moved rows are read from) both leave exactly the gathered rows, and
    # appending still works.
    from closedloop.engine.hf_generator import compaction_order
    from closedloop.engine.kv_cache import GrowingKVLayer

    gen = torch.Generator().manual_seed(seed)
    b = len(alive)
    layer = GrowingKVLayer(reserve=16)
    k0, v0 = torch.randn(b, 2, 5, 3, generator=gen), torch.randn(b, 2, 5, 3, generator=gen)
    layer.update(k0, v0)
    order = compaction_order(alive)
    if shuffle:
        order = [order[i] for i in torch.randperm(len(order), generator=gen).tolist()]
    idx = torch.tensor(order)
    layer.batch_select_indices(idx)
    assert torch.equal(layer.keys, k0[idx]) and torch.equal(layer.values, v0[idx])
    k1, v1 = torch.randn(len(order), 2, 1, 3, generator=gen), torch.randn(len(order), 2, 1, 3,
                                                                          generator=gen)
    got_k, got_v = layer.update(k1, v1)
    assert torch.equal(got_k, torch.cat([k0[idx], k1], 2))
    assert torch.equal(got_v, torch.cat([v0[idx], v1], 2))


def test_row_cache_squeezes_padding():
    from transformers import DynamicCache

    from closedloop.engine.kv_cache import mask_runs, row_cache

    assert mask_runs([0, 0, 1, 1, 0, 1, 1, 1]) == [(2, 4), (5, 8)]
    assert mask_runs([1, 1]) == [(0, 2)] and mask_runs([0]) == []
    keys = torch.arange(2 * 1 * 8 * 2, dtype=torch.float32).reshape(2, 1, 8, 2)
    cache = DynamicCache(ddp_cache_data=[(keys, -keys)])
    mask = torch.tensor([0, 0, 1, 1, 0, 1, 1, 1])
    ((k, v),) = row_cache(cache, 1, mask)
    assert torch.equal(k, keys[1:, :, mask.bool()]) and torch.equal(v, -k)
    assert k.shape == (1, 1, 5, 2) and k.untyped_storage().data_ptr() != \
        keys.untyped_storage().data_ptr()


def test_batched_rows_equal_single_rows(peaked_model, tokenizer, renderer):
    tasks = ["short", "a much longer task statement that pads the other rows " * 3, "mid task"]
    batched = HFGenerator(peaked_model, tokenizer)
    _, rec = run_episodes(batched, renderer, tasks, GREEDY)
    for i, task in enumerate(tasks):
        _, alone = run_episodes(HFGenerator(peaked_model, tokenizer), renderer, [task], GREEDY)
        for (_, a), (_, b) in zip(rec[i], alone[0], strict=True):
            assert a.action_token_ids == b.action_token_ids
            assert np.allclose(a.raw_model_logprobs, b.raw_model_logprobs, atol=1e-4)


# ---------------------------------------------------------------- trainer path
def test_trainer_recompute_matches_recorded_raw_logprobs(tiny_model, tokenizer, renderer):
    gen = HFGenerator(tiny_model, tokenizer)
    sids, rec = run_episodes(gen, renderer, ["Repair a.json", "Fix b", "c"], NUCLEUS)
    ids, mask = right_padded([gen.context(s) for s in sids])
    with torch.no_grad():
        lp = sequence_logprobs(tiny_model, ids, mask)  # lp[:, t] scores ids[:, t + 1]
    worst, n = 0.0, 0
    for i, row in enumerate(rec):
        assert len(row) == 3
        for start, g in row:
            k = len(g.action_token_ids)
            assert ids[i, start:start + k].tolist() == g.action_token_ids
            got = lp[i, start - 1:start - 1 + k]
            worst = max(worst, float((got - torch.tensor(g.raw_model_logprobs)).abs().max()))
            n += k
    assert n > 20 and worst < 1e-4
    # a one-token shift is caught: scoring the same ids one position late is far off
    start, g = rec[0][1]
    late = lp[0, start:start + len(g.action_token_ids)]
    assert float((late - torch.tensor(g.raw_model_logprobs)).abs().max()) > 1e-2


def test_behavior_logprobs_are_the_transformed_distribution(peaked_model, tokenizer, renderer):
    gen = HFGenerator(peaked_model, tokenizer)
    sids, rec = run_episodes(gen, renderer, ["Repair a.json", "Fix b"], NUCLEUS)
    gaps = []
    for sid, row in zip(sids, rec, strict=True):
        ctx = torch.tensor([gen.context(sid)])
        with torch.no_grad():
            logits_T_V = peaked_model(ctx).logits[0].double()
        for start, g in row:
            for k, (tok, beh, raw) in enumerate(zip(g.action_token_ids, g.behavior_logprobs,
                                                    g.raw_model_logprobs, strict=True)):
                want = reference_logprobs(logits_T_V[start - 1 + k].numpy(), NUCLEUS)[tok]
                # The decode path (KV cache, fused products) and this full forward differ in
                # fp32 summation order: on this peaked model (|logits| ~13, temperature 0.7)
                # that alone moves a log-prob by up to ~1e-4, against a raw gap of > 0.1.
                assert beh == pytest.approx(want, abs=3e-4)
                gaps.append(abs(beh - raw))
    assert max(gaps) > 0.1  # the raw model distribution is not the sampler's


def test_score_is_the_behaviour_logprob_sampling_records_for_the_same_ids(
        peaked_model, tokenizer, renderer):
    """``score(ids)`` is, teacher-forced in one prefill, what sampling records: the sampler's
    log-prob of each id after the ids before it. Scoring opens no session and changes none:
    a session sampled after it samples what it would have without it."""
    tempered = SamplerConfig(temperature=0.7)
    prompt = renderer.encode(renderer.template.render_messages(
        [ChatMessage("user", "Repair a.json")], add_generation_prompt=True))

    def sample(gen):
        sid = gen.open_session(prompt, stream=3)
        (g,) = gen.generate_batch([sid], tempered, max_new_tokens=12)
        gen.close(sid)
        return g

    gen = HFGenerator(peaked_model, tokenizer, seed=0)
    g = sample(gen)
    ids = list(prompt) + g.action_token_ids
    scored = gen.score(ids, tempered)
    assert len(scored) == len(ids) - 1 and not gen._sessions
    # the decode path and one prefill differ only in fp32 summation order (~1e-4 here)
    assert scored[len(prompt) - 1:] == pytest.approx(g.behavior_logprobs, abs=3e-4)
    with torch.no_grad():
        logits_T_V = peaked_model(torch.tensor([ids])).logits[0].double()
    want = [reference_logprobs(logits_T_V[t].numpy(), tempered)[ids[t + 1]]
            for t in range(len(ids) - 1)]
    assert scored == pytest.approx(want, abs=3e-4)
    assert sample(gen) == g  # the sessions' streams and caches are untouched
    with pytest.raises(GenerationError, match="at least two ids"):
        gen.score(ids[:1], tempered)
    with pytest.raises(GenerationError, match="token ids must be in"):
        gen.score([0, tokenizer.vocab_size + 5], tempered)


def test_sequence_logprobs_padding_and_targets(tiny_model):
    torch.manual_seed(0)
    a, b = torch.randint(0, 49152, (7,)).tolist(), torch.randint(0, 49152, (4,)).tolist()
    ids_r, mask_r = right_padded([a, b])
    ids_l = torch.tensor([a, [0] * 3 + b])
    mask_l = torch.tensor([[1] * 7, [0] * 3 + [1] * 4])
    with torch.no_grad():
        lp_r = sequence_logprobs(tiny_model, ids_r, mask_r)
        lp_l = sequence_logprobs(tiny_model, ids_l, mask_l)
        only = torch.zeros(2, 6)
        only[0, 2] = 1
        lp_t = sequence_logprobs(tiny_model, ids_r, mask_r, target_mask_B_T=only)
    assert lp_r.shape == (2, 6)
    assert torch.allclose(lp_r[0], lp_l[0], atol=1e-5)
    assert torch.allclose(lp_r[1, :3], lp_l[1, 3:], atol=1e-5)
    assert lp_r[1, 3:].abs().sum() == 0 and lp_l[1, :3].abs().sum() == 0
    assert lp_t[0, 2] == pytest.approx(float(lp_r[0, 2]), abs=1e-6)
    assert lp_t.count_nonzero() == 1
    with pytest.raises(LogprobInputError):
        sequence_logprobs(tiny_model, ids_r, torch.tensor([[1, 0, 1, 1, 1, 1, 1]] * 2))


# ---------------------------------------------------------------- sessions
def test_protocol_seed_fork_refresh_and_errors(tiny_model, tokenizer, renderer):
    gen = HFGenerator(tiny_model, tokenizer)
    assert isinstance(gen, Generator) and gen.weight_checksum.startswith("sha256:")
    prompt = renderer.render_prompt("Repair a.json")
    a = gen.generate(prompt, NUCLEUS, renderer.stop_sequences, 8, seed=5)
    assert a == gen.generate(prompt, NUCLEUS, renderer.stop_sequences, 8, seed=5)
    sid = gen.open_session(prompt)
    gen.generate_batch([sid], NUCLEUS, max_new_tokens=4)
    twin = gen.fork(sid)
    assert gen.context(twin) == gen.context(sid)
    before = gen.stats.prefill_tokens
    gen.refresh_weights()
    out = gen.generate_batch([sid], GREEDY, max_new_tokens=2)
    assert gen.stats.prefill_tokens - before == len(prompt) + 4  # whole context re-prefilled
    assert len(out[0].action_token_ids) == 2
    gen.close(twin)
    with pytest.raises(GenerationError):
        gen.extend(twin, [1])
    with pytest.raises(GenerationError):
        gen.open_sessions([[]])
    with pytest.raises(GenerationError):
        gen.extend(sid, [10**6])
    with pytest.raises(GenerationError):
        gen.generate_batch([sid, sid], GREEDY, max_new_tokens=2)
    small = HFGenerator(tiny_model, tokenizer, max_context=len(prompt) + 3)
    ok, = small.open_sessions([prompt])
    assert small.remaining(ok) == 3
    with pytest.raises(ContextOverflowError) as err:
        small.generate_batch([ok], GREEDY, max_new_tokens=4)
    assert err.value.sessions == [ok]
    assert len(small.generate_batch([ok], GREEDY, max_new_tokens=3)[0].action_token_ids) == 3


# ---------------------------------------------------------------- paired sampling streams
def stream_episode(gen, renderer, task, stream, companions=(), turns=3):
    """The action ids of one session opened with ``stream`` over ``turns`` turns, sampled in
    batches with ``companions`` (other tasks, their own streams)."""
    prompts = [renderer.render_prompt(t) for t in (task, *companions)]
    sids = gen.open_sessions(prompts, [stream, *(100 + i for i in range(len(companions)))])
    ids = []
    for turn in range(turns):
        outs = gen.generate_batch(sids, NUCLEUS, renderer.stop_sequences, 10)
        ids.append(outs[0].action_token_ids)
        for sid, g in zip(sids, outs, strict=True):
            gen.extend(sid, renderer.render_observation(
                f"obs {turn}", turn_closed=renderer.turn_closed(g.action_token_ids)))
    return ids


def test_a_streamed_session_samples_the_same_whatever_its_batch(tiny_model, tokenizer,
                                                                renderer):
    alone = stream_episode(HFGenerator(tiny_model, tokenizer), renderer, "Repair a.json", 7)
    crowded = stream_episode(HFGenerator(tiny_model, tokenizer, seed=99), renderer,
                             "Repair a.json", 7, companions=("b", "a longer task " * 5))
    assert alone == crowded  # neither the batch nor the generator's own rng matter
    other = stream_episode(HFGenerator(tiny_model, tokenizer), renderer, "Repair a.json", 8)
    assert other != alone  # another stream samples otherwise


def test_a_batch_cannot_mix_streamed_and_shared_sessions(tiny_model, tokenizer, renderer):
    gen = HFGenerator(tiny_model, tokenizer)
    prompt = renderer.render_prompt("Repair a.json")
    streamed = gen.open_session(prompt, stream=3)
    shared = gen.open_session(prompt)
    with pytest.raises(GenerationError):
        gen.generate_batch([streamed, shared], NUCLEUS, max_new_tokens=2)
    with pytest.raises(GenerationError):
        gen.open_sessions([prompt, prompt], [1])
    twin = gen.fork(streamed)  # a fork continues the same stream
    a, b = gen.generate_batch([streamed, twin], NUCLEUS, max_new_tokens=6)
    assert a.action_token_ids == b.action_token_ids


# ---------------------------------------------------------------- weights change under a session
def test_a_kv_cache_from_old_weights_is_never_reused_under_new_ones(tokenizer, renderer):
    """After ``refresh_weights`` a session prefills its whole context under the new weights:
    it samples exactly what a fresh session on the same ids and stream does, and not what the
    keys and values computed under the old weights would have made it sample."""
    from closedloop.policy import attach_lora, build_tiny_model

    model = attach_lora(build_tiny_model(tokenizer, seed=0), r=4, alpha=8, seed=1,
                        target_modules=("q_proj", "k_proj", "v_proj"))
    gen = HFGenerator(model, tokenizer)
    sid = gen.open_session(renderer.render_prompt("Repair a.json"), stream=3)
    gen.generate_batch([sid], NUCLEUS, max_new_tokens=4)
    gen.extend(sid, renderer.render_observation("obs"))
    old = gen._sessions[sid]
    stale_kv, stale_cached = old.kv, old.n_cached
    assert stale_kv is not None and stale_cached > 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.5)
    gen.refresh_weights()
    assert gen._sessions[sid].kv is None and gen._sessions[sid].n_cached == 0
    state, context = gen.stream_state(sid), gen.context(sid)

    def twin(kv=None, cached=0):
        s = gen.open_session(context)
        gen.set_stream_state(s, state)
        gen._sessions[s].kv, gen._sessions[s].n_cached = kv, cached
        return gen.generate_batch([s], NUCLEUS, max_new_tokens=6)[0]

    after = gen.generate_batch([sid], NUCLEUS, max_new_tokens=6)[0]
    assert after == twin()
    stale = twin(stale_kv, stale_cached)  # what reusing the old keys and values would sample
    assert stale.behavior_logprobs != after.behavior_logprobs


def test_fresh_prompts_prefill_the_ids_they_share_once(tiny_model, tokenizer, renderer):
    """Distinct prompts under one scaffold prefill their common leading ids once; each row's
    first action is what it samples alone. The no-reuse baseline prefills them whole."""
    from closedloop.engine.hf_generator import SHARED_PREFIX_MIN, common_prefix_length

    prompts = [renderer.render_prompt(t) for t in ["Repair a.json", "Fix b", "c", "Fix b"]]
    shared = common_prefix_length(prompts)
    assert prompts[0][shared] != prompts[1][shared]
    assert shared >= SHARED_PREFIX_MIN
    gen = HFGenerator(tiny_model, tokenizer)
    outs = gen.generate_batch(gen.open_sessions(prompts), GREEDY, max_new_tokens=4)
    distinct = list(dict.fromkeys(map(tuple, prompts)))
    assert gen.stats.prefill_tokens == shared + sum(len(p) - shared for p in distinct)
    for prompt, got in zip(prompts, outs, strict=True):
        alone = HFGenerator(tiny_model, tokenizer)
        want = alone.generate_batch([alone.open_session(prompt)], GREEDY, max_new_tokens=4)[0]
        assert got.action_token_ids == want.action_token_ids
        assert np.allclose(got.raw_model_logprobs, want.raw_model_logprobs, atol=1e-5)
    baseline = HFGenerator(tiny_model, tokenizer, reprefill=True)
    baseline.generate_batch(baseline.open_sessions(prompts), GREEDY, max_new_tokens=4)
    assert baseline.stats.prefill_tokens == sum(len(p) for p in distinct)
    unshared = HFGenerator(tiny_model, tokenizer, share_prompt_prefix=False)
    again = unshared.generate_batch(unshared.open_sessions(prompts), GREEDY, max_new_tokens=4)
    assert unshared.stats.prefill_tokens == sum(len(p) for p in distinct)
    assert [g.action_token_ids for g in again] == [g.action_token_ids for g in outs]


@given(st.lists(st.lists(st.integers(0, 3), max_size=6), min_size=1, max_size=4))
def test_common_prefix_length_is_the_longest_shared_start(seqs):
    from closedloop.engine.hf_generator import common_prefix_length

    n = common_prefix_length(seqs)
    assert all(x[:n] == seqs[0][:n] for x in seqs)
    assert n == min(map(len, seqs)) or len({x[n] for x in seqs}) > 1
