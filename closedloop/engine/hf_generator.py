"""Batched generation with a transformers causal LM and per-session KV-cache reuse.

A *session* is one growing context (one episode of one rollout). Its ids are threaded:
``open_sessions([prompt])`` -> ``generate_batch`` appends the action ids -> ``extend`` appends the
observation delta ids -> ``generate_batch`` ... Each session keeps the keys/values of its already
processed ids (``[1, H_kv, n_cached, D]`` per layer), so a turn prefills only the ids added since
the last one (an appended observation extends the cached prefix: token-id threading,
docs/concepts.md); ``reprefill=True`` drops the caches before every batch and prefills whole
contexts (the no-reuse baseline for benchmarks).

One ``generate_batch`` call steps all its sessions together:

1. prefill: row ``b`` has ``c_b`` cached and ``p_b`` pending ids. The batched cache is
   ``[pad]*(C-c_b) + cache_b`` and the input ``[pad]*(P-p_b) + pending_b`` (C, P the maxima), so
   the attention mask is ``0^(C-c_b) 1^c_b 0^(P-p_b) 1^p_b`` and positions are given explicitly
   (``c_b + arange(p_b)``), which makes the padding invisible to RoPE and attention (the lean
   copy also leaves it out of the dense work). Rows with the same cache object and the same
   pending ids (G siblings at turn 0) are prefilled once, and fresh sessions with different
   prompts prefill the ids their prompts begin with in common (the scaffold's system message)
   once.
2. decode: sample each live row (``sampling.sample_step``), append, check stops; a finished row
   leaves the batch and its cache (padding squeezed out) returns to its session.

Forwards run on the generator's own copy of the weights, synced from the policy at
construction and in ``refresh_weights``: for a Llama policy (``llama_decode.supports``), the
flat ``LlamaDecodeCopy`` (merged LoRA, fused QKV and gate/up products, grouped decode attention
without K/V copies; it re-syncs only blocks whose weights changed), otherwise the module-tree
``DecodeCopy`` (merged LoRA, transposed Linear weights), which serves any other causal LM a
local model folder may hold. ``precision`` (``closedloop.engine.precision``: ``float32`` or
``bfloat16`` matmuls) is applied the same way the trainer applies it, so the auditor compares
like with like. Seven switches exist for comparison only (benchmarks and tests):
``lean_decode=False`` forces the module copy on a Llama, ``packed_weights=False`` keeps the lean
copy's weights strided instead of oneDNN-packed, ``packed_prefill=False`` runs a padded prefill's
padding through the lean copy's products, ``share_prompt_prefix=False`` prefills every distinct
prompt whole, ``fused_attention=False`` runs the lean copy's decode attention as batched
matmuls instead of its C loops, ``decode_copy=False`` runs the policy module itself,
``reprefill=True`` drops the caches.

The last sampled id of an action is not fed to the model: it is the first pending id of the next
turn. Sampling draws one float64 uniform per live row from the ``torch.Generator`` per step
(``closedloop.policy.sampling.sample``), so samples are reproducible for a given seed *and*
batch composition. ``closedloop.engine.transformers_path.reference_generate`` is the same sampling
without caches or copies.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from closedloop.contracts import TOOL_CALL_CLOSE, SamplerConfig
from closedloop.engine.decode_copy import DecodeCopy
from closedloop.engine.device import model_device
from closedloop.engine.llama_decode import LlamaDecodeCopy, supports
from closedloop.engine.precision import check_precision, matmul_precision
from closedloop.engine.token_ids import checked_token_ids
from closedloop.errors import GenerationError
from closedloop.policy.generator import (
    FinishReason,
    Generation,
    StopMatcher,
    batch_states,
    default_stop_token_ids,
    session_state,
)
from closedloop.policy.sampling import sample_step, transform_logits

SessionId = int
SHARED_PREFIX_MIN = 16
"""Fresh sessions of one batch whose distinct prompts share at least this many leading ids
prefill them once (``HFGenerator._share_prompt_prefix``)."""
KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each [1, H, n, D]


@dataclass
class _Session:
    ids: list[int]
    kv: KV | None = None
    n_cached: int = 0
    rng: torch.Generator | None = None  # the session's own sampling stream, if opened with one


@dataclass
class GeneratorStats:
    """Counters since construction: ids prefilled/decoded, forward calls, batches, seconds."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    forward_calls: int = 0
    batches: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0


@dataclass
class _Row:
    session: SessionId
    ids: list[int] = field(default_factory=list)
    behavior: list[float] = field(default_factory=list)
    raw: list[float] = field(default_factory=list)
    finish: FinishReason | None = None


class HFGenerator:
    """Stateful batched generator over a transformers causal LM (see module doc).

    ``stop_token_ids`` default to ``default_stop_token_ids(tokenizer)`` (EOS, ``<|im_end|>``,
    ``<|endoftext|>``); ``stop_sequences`` and the ``seed`` of ``self.rng`` are the defaults of
    ``generate_batch`` calls that pass none. ``max_context`` (default
    ``config.max_position_embeddings``) bounds context + new ids: a batch with a session that
    could exceed it raises ``ContextOverflowError`` (check ``remaining(session)`` first).
    ``weight_checksum`` is computed from the model unless given; call ``refresh_weights`` after
    changing the weights in place (it re-syncs the decode copy and drops every KV cache: they
    belong to old weights). Until then the generator keeps
    sampling from the weights it last synced, as a rollout engine keeps its published weights.
    """

    def __init__(self, model: Any, tokenizer: Any, *, weight_checksum: str | None = None,
                 reprefill: bool = False, stop_token_ids: Sequence[int] | None = None,
                 stop_sequences: Sequence[str] = (TOOL_CALL_CLOSE,), seed: int = 0,
                 max_context: int | None = None,
                 decode_copy: bool = True, precision: str = "float32",
                 lean_decode: bool = True, packed_weights: bool = True,
                 packed_prefill: bool = True, share_prompt_prefix: bool = True,
                 fused_attention: bool = True) -> None:
        self.model = model
        self.device = model_device(model)  # inputs are built here (closedloop.engine.device)
        self.precision = check_precision(precision)
        self._decode: DecodeCopy | LlamaDecodeCopy | None = None
        if decode_copy and lean_decode and supports(model) is None:
            self._decode = LlamaDecodeCopy(model, precision, packed=packed_weights,
                                           packed_prefill=packed_prefill,
                                           fused_attention=fused_attention)
        elif decode_copy:
            self._decode = DecodeCopy(model, precision)
        self.max_context = int(max_context or getattr(model.config, "max_position_embeddings",
                                                      None) or 2**31 - 1)
        self.stop_sequences = tuple(stop_sequences)
        self.rng = torch.Generator().manual_seed(seed)
        self.tokenizer = tokenizer
        self.reprefill = reprefill
        self.share_prompt_prefix = share_prompt_prefix
        self.stop_token_ids = tuple(stop_token_ids) if stop_token_ids is not None \
            else default_stop_token_ids(tokenizer)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.stats = GeneratorStats()
        self._checksum = weight_checksum
        self._sessions: dict[SessionId, _Session] = {}
        self._next_id = itertools.count()

    @property
    def weight_checksum(self) -> str:
        """The checksum of the sampling weights (computed once, or given).

        For a LoRA model it is the combined base + adapter checksum (``policy_weight_checksum``),
        the manifest's ``weight_checksum``.
        """
        if self._checksum is None:
            from closedloop.policy.lora import policy_weight_checksum

            self._checksum = policy_weight_checksum(self.model).combined
        return self._checksum

    def refresh_weights(self, weight_checksum: str | None = None, force: bool = False) -> None:
        """Declare the weights changed: re-sync the decode copy, drop all KV caches, and take
        ``weight_checksum`` (or recompute it lazily).

        The lean copy re-syncs the blocks whose tensors moved (storage or version counter);
        after writes made through ``.data``, pass ``force=True`` to rebuild every block.
        """
        self._checksum = weight_checksum
        if isinstance(self._decode, LlamaDecodeCopy):
            self._decode.sync(force=force)
        elif self._decode is not None:
            self._decode.sync()
        for s in self._sessions.values():
            s.kv, s.n_cached = None, 0

    # -- sessions ---------------------------------------------------------------------------
    def open_sessions(self, prompts: Sequence[Sequence[int]],
                      streams: Sequence[int] | None = None) -> list[SessionId]:
        """Open one session per prompt (token ids); return their ids.

        ``streams`` gives each session its own sampling stream, a generator seeded with that
        integer: every id it samples then draws its uniform from that stream, in order, whatever
        other sessions share its batches (sessions opened with the same stream on policies that
        agree sample the same ids: common random numbers for paired comparisons). A batch must
        hold only sessions with streams or only sessions without (these share ``generator``).
        """
        if streams is not None and len(streams) != len(prompts):
            raise GenerationError(f"{len(streams)} streams for {len(prompts)} prompts")
        out = []
        for i, prompt in enumerate(prompts):
            ids = self._checked_ids(prompt)
            if not ids:
                raise GenerationError("a session needs a non-empty prompt")
            sid = next(self._next_id)
            rng = None
            if streams is not None:
                rng = torch.Generator().manual_seed(int(streams[i]) % 2**63)
            self._sessions[sid] = _Session(ids, rng=rng)
            out.append(sid)
        return out

    def open_session(self, prompt: Sequence[int], stream: int | None = None) -> SessionId:
        """Open one session (``open_sessions([prompt], [stream])[0]``)."""
        return self.open_sessions([prompt], None if stream is None else [stream])[0]

    def extend(self, session: SessionId, ids: Sequence[int]) -> None:
        """Append ids (an observation delta) to a session's context; they prefill next turn."""
        self._session(session).ids.extend(self._checked_ids(ids))

    def fork(self, session: SessionId) -> SessionId:
        """Open a copy of a session sharing its (immutable) KV cache; for branching."""
        src = self._session(session)
        sid = next(self._next_id)
        rng = None
        if src.rng is not None:  # the copy continues from the same point of the stream
            rng = torch.Generator()
            rng.set_state(src.rng.get_state())
        self._sessions[sid] = _Session(list(src.ids), src.kv, src.n_cached, rng)
        return sid

    def context(self, session: SessionId) -> list[int]:
        """Return a copy of the session's whole context ids."""
        return list(self._session(session).ids)

    def stream_state(self, session: SessionId) -> torch.Tensor | None:
        """The state of the session's own sampling stream (``None``: it samples from the
        batch's shared generator)."""
        rng = self._session(session).rng
        return None if rng is None else rng.get_state()

    def set_stream_state(self, session: SessionId, state: torch.Tensor | None) -> None:
        """Give the session its own sampling stream, continuing from ``state`` (what
        ``stream_state`` returned for a paused session); ``None`` leaves it on the shared
        generator. With the exact context ids and this state, a resumed session samples what
        the paused one would have."""
        if state is None:
            return
        rng = torch.Generator()
        rng.set_state(state)
        self._session(session).rng = rng

    def remaining(self, session: SessionId) -> int:
        """Return how many more ids fit in the session's context window."""
        return self.max_context - len(self._session(session).ids)

    def close(self, session: SessionId) -> None:
        """Forget a session and free its cache."""
        self._sessions.pop(session, None)

    # -- generation -------------------------------------------------------------------------
    def generate(self, context_token_ids: Sequence[int], sampler: SamplerConfig,
                 stop: Sequence[str], max_new_tokens: int, seed: int) -> Generation:
        """The ``Generator`` protocol: one context, one action, seeded."""
        (sid,) = self.open_sessions([context_token_ids])
        try:
            rng = torch.Generator().manual_seed(seed)
            return self.generate_batch([sid], sampler, stop, max_new_tokens, rng)[0]
        finally:
            self.close(sid)

    @torch.no_grad()
    def generate_batch(self, sessions: Sequence[SessionId], sampler: SamplerConfig,
                       stop_sequences: Sequence[str] | None = None, max_new_tokens: int = 256,
                       generator: torch.Generator | None = None) -> list[Generation]:
        """Generate one action for every session, stepping them together (module doc).

        ``stop_sequences``/``generator`` default to the constructor's (``</tool_call>``,
        ``self.rng``); sessions opened with streams sample from their own (``open_sessions``).
        Returns one ``Generation`` per session, in order; each session's context then ends with
        its action ids.
        """
        stop_sequences = self.stop_sequences if stop_sequences is None else stop_sequences
        generator = self.rng if generator is None else generator
        states = self._batch_states(sessions, max_new_tokens)
        own = [st.rng for st in states]
        if any(g is not None for g in own) and not all(g is not None for g in own):
            raise GenerationError("a batch mixes sessions with and without their own sampling "
                                  "streams")
        matcher = StopMatcher(self.tokenizer, stop_sequences, self.stop_token_ids)
        t0 = time.perf_counter()
        logits_B_V, cache, mask_B_L, pos_B = self._prefill(states, max_new_tokens)
        t1 = time.perf_counter()
        rows = [_Row(s) for s in sessions]
        live = list(range(len(rows)))
        for _ in range(max_new_tokens):
            rows_rng = [own[r] for r in live] if own[0] is not None else generator
            step = sample_step(logits_B_V, sampler, rows_rng)  # type: ignore[arg-type]
            picked = (step.ids_B.tolist(), step.behavior_logprobs_B.tolist(),
                      step.raw_logprobs_B.tolist())
            for j, r in enumerate(live):
                _record(rows[r], picked, j, matcher, max_new_tokens)
                if rows[r].finish is not None:
                    self._finish(states[r], rows[r], cache, j, mask_B_L[j])
            alive = [rows[r].finish is None for r in live]
            if not any(alive):
                break
            order = compaction_order(alive)
            live = [live[j] for j in order]
            idx = torch.tensor(order, device=self.device)
            if len(order) < len(mask_B_L):
                cache.batch_select_indices(idx)
            last_B_1 = torch.tensor([[rows[r].ids[-1]] for r in live], device=self.device)
            mask_B_L = torch.cat([mask_B_L[idx], torch.ones(len(order), 1, dtype=torch.long,
                                                            device=self.device)], 1)
            pos_B = pos_B[idx] + 1
            logits_B_V = self._forward(last_B_1, mask_B_L, pos_B[:, None], cache)
            self.stats.decode_tokens += len(order)
        self.stats.batches += 1
        self.stats.prefill_s += t1 - t0
        self.stats.decode_s += time.perf_counter() - t1
        return [Generation(r.ids, r.behavior, r.raw, r.finish or "length") for r in rows]

    def _batch_states(self, sessions: Sequence[SessionId], max_new: int) -> list[_Session]:
        """Validate a batch request (``batch_states``); drop the caches first when
        re-prefilling."""
        states = batch_states(self._sessions, sessions, max_new, self.max_context)
        if self.reprefill:
            for st in states:
                st.kv, st.n_cached = None, 0
        return states

    def _share_prompt_prefix(self, states: list[_Session]) -> None:
        """Prefill once the leading ids that the batch's fresh sessions (nothing cached) share,
        when their prompts differ and share at least ``SHARED_PREFIX_MIN`` ids: every fresh
        session then holds that prefix's keys/values (one immutable cache, as ``fork``
        shares) and prefills only the rest. Episodes of different tasks under one scaffold
        share its system message (216 of SmolLM2's ~350 prompt ids in the terminal tasks),
        which was otherwise prefilled once per distinct prompt. Each prompt keeps at least one
        pending id, whose logits the first sample needs."""
        if self.reprefill or not self.share_prompt_prefix:  # the no-reuse baseline: whole
            return
        fresh = [st for st in states if st.kv is None]
        prompts = list(dict.fromkeys(tuple(st.ids) for st in fresh))
        if len(prompts) < 2:
            return
        shared = min(common_prefix_length(prompts), min(len(x) for x in prompts) - 1)
        if shared < SHARED_PREFIX_MIN:
            return
        from closedloop.engine.kv_cache import batch_cache, row_cache  # imports transformers

        cache = batch_cache([None], 0, shared)
        ones_1_L = torch.ones(1, shared, dtype=torch.long, device=self.device)
        self._forward(torch.tensor([prompts[0][:shared]], device=self.device), ones_1_L,
                      torch.arange(shared, device=self.device)[None], cache)
        kv = row_cache(cache, 0, ones_1_L[0])
        for st in fresh:
            st.kv, st.n_cached = kv, shared
        self.stats.prefill_tokens += shared

    def _prefill(self, states: list[_Session], max_new: int) -> tuple[torch.Tensor, Any,
                                                                       torch.Tensor, torch.Tensor]:
        """Prefill pending ids of unique rows; return last logits, cache, mask, last positions."""
        self._share_prompt_prefix(states)
        keys = [(id(st.kv), st.n_cached, tuple(st.ids[st.n_cached:])) for st in states]
        unique: dict[tuple[int, int, tuple[int, ...]], int] = {}
        for key in keys:
            unique.setdefault(key, len(unique))
        firsts = [states[keys.index(k)] for k in unique]
        c_max = max(st.n_cached for st in firsts)
        p_max = max(len(st.ids) - st.n_cached for st in firsts)
        inputs, masks, positions = [], [], []
        for st in firsts:
            p = len(st.ids) - st.n_cached
            if p < 1:
                raise GenerationError("a session has no pending ids (generate twice in a row?)")
            inputs.append([self.pad_id] * (p_max - p) + st.ids[st.n_cached:])
            masks.append([0] * (c_max - st.n_cached) + [1] * st.n_cached
                         + [0] * (p_max - p) + [1] * p)
            positions.append([0] * (p_max - p) + list(range(st.n_cached, st.n_cached + p)))
        from closedloop.engine.kv_cache import batch_cache  # imports transformers

        cache = batch_cache([st.kv for st in firsts], c_max, c_max + p_max + max_new)
        mask_U_L = torch.tensor(masks, device=self.device)
        pos_U_P = torch.tensor(positions, device=self.device)
        logits_U_V = self._forward(torch.tensor(inputs, device=self.device), mask_U_L, pos_U_P,
                                   cache)
        self.stats.prefill_tokens += sum(len(st.ids) - st.n_cached for st in firsts)
        expand = torch.tensor([unique[k] for k in keys], device=self.device)
        if len(unique) < len(keys):
            cache.batch_select_indices(expand)
        return logits_U_V[expand], cache, mask_U_L[expand], pos_U_P[expand, -1]

    def _forward(self, input_B_P: torch.Tensor, mask_B_L: torch.Tensor, pos_B_P: torch.Tensor,
                 cache: Any) -> torch.Tensor:
        if isinstance(self._decode, LlamaDecodeCopy):
            logits_B_V = self._decode.last_logits(input_B_P, mask_B_L, pos_B_P, cache)
        else:
            logits_B_V = self._tail_logits(input_B_P, mask_B_L, pos_B_P, cache, 1)[:, -1]
        self.stats.forward_calls += 1
        return logits_B_V

    def _tail_logits(self, input_B_P: torch.Tensor, mask_B_L: torch.Tensor,
                     pos_B_P: torch.Tensor, cache: Any, keep: int) -> torch.Tensor:
        """The float32 logits ``[B, keep, V]`` of the last ``keep`` input positions."""
        if isinstance(self._decode, LlamaDecodeCopy):
            return self._decode.tail_logits(input_B_P, mask_B_L, pos_B_P, cache, keep)
        kwargs = dict(input_ids=input_B_P, attention_mask=mask_B_L, position_ids=pos_B_P,
                      cache=cache, use_cache=True, logits_to_keep=keep)
        if self._decode is not None:
            out = self._decode(**kwargs)
        else:
            with matmul_precision(self.model, self.precision):
                out = self.model(**kwargs)
        return out.logits[:, -keep:, :].float()

    # -- teacher-forced scoring ---------------------------------------------------------------
    def score(self, token_ids: Sequence[int], sampler: SamplerConfig) -> list[float]:
        """Teacher-forced log-probs of a fixed sequence on the generator's own weights: for
        ``t = 1 .. n-1``, ``transform_logits(z_t, sampler)[ids[t]]`` (the behaviour log-prob
        sampling would record for ``ids[t]``), with ``z_t`` the logits after ``ids[:t]``.

        One prefill of ``ids[:-1]`` through the same forward the sessions use, in a cache of
        its own (no session is opened or touched); ``n - 1`` values."""
        ids = self._checked_ids(token_ids)
        if len(ids) < 2:
            raise GenerationError("score needs at least two ids (one to condition on)")
        from closedloop.engine.kv_cache import batch_cache  # imports transformers

        n = len(ids) - 1
        with torch.no_grad():
            logits_1_N_V = self._tail_logits(
                torch.tensor([ids[:-1]], device=self.device),
                torch.ones(1, n, dtype=torch.long, device=self.device),
                torch.arange(n, device=self.device)[None], batch_cache([None], 0, n), n)
            logprobs_N_V = transform_logits(logits_1_N_V[0], sampler)
            picked = logprobs_N_V.gather(-1, torch.tensor(ids[1:], device=self.device)[:, None])
        self.stats.forward_calls += 1
        return [float(x) for x in picked[:, 0].cpu()]

    def _finish(self, st: _Session, row: _Row, cache: Any, j: int, mask_L: torch.Tensor) -> None:
        """Hand a finished row's ids and its cache (padding squeezed out) back to its session."""
        from closedloop.engine.kv_cache import row_cache

        st.kv = None if self.reprefill else row_cache(cache, j, mask_L)
        st.ids.extend(row.ids)
        st.n_cached = len(st.ids) - 1 if st.kv is not None else 0

    def _session(self, session: SessionId) -> _Session:
        return session_state(self._sessions, session)

    def _checked_ids(self, ids: Sequence[int]) -> list[int]:
        return checked_token_ids(ids, self.vocab_size)


def _record(row: _Row, picked: tuple[list[int], list[float], list[float]], j: int,
            matcher: StopMatcher, max_new: int) -> None:
    """Append row ``j`` of a sampling step (ids, behaviour, raw lists) to ``row``; decide
    whether it finished."""
    row.ids.append(picked[0][j])
    row.behavior.append(picked[1][j])
    row.raw.append(picked[2][j])
    row.finish = matcher.check(row.ids)
    if row.finish is None and len(row.ids) >= max_new:
        row.finish = "length"


def common_prefix_length(seqs: Sequence[Sequence[int]]) -> int:
    """The number of leading ids every sequence of ``seqs`` has in common (0 for none)."""
    first, n = seqs[0], min(len(x) for x in seqs)
    for i in range(n):
        if any(x[i] != first[i] for x in seqs):
            return i
    return n


def compaction_order(alive: Sequence[bool]) -> list[int]:
    """The batch positions that stay, in their new order, after some rows finished.

    A live row below the new batch size ``n = sum(alive)`` keeps its position; each finished
    position below ``n`` takes a live row from ``n`` or above. So only one row per finished slot
    moves, and a cache compacts in place by copying those rows
    (``GrowingKVLayer.batch_select_indices``) instead of gathering the whole batch.
    """
    n = sum(1 for a in alive if a)
    movers = [j for j in range(n, len(alive)) if alive[j]]
    return [j if alive[j] else movers.pop() for j in range(n)]
