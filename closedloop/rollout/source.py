"""Action sources: who writes the action tokens of an episode.

The collector drives every episode through one ``ActionSource``: a language-model generator
(``GeneratorSource``, batched with KV reuse) or a scripted policy (``ScriptedSource``, whose
episodes are demonstrations). A source sees token ids the collector threads; it never
re-tokenizes a conversation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from closedloop.contracts import Action, SamplerConfig
from closedloop.contracts.records import GenerationFinish
from closedloop.errors import ContextBudgetExceeded, ContextOverflowError


@dataclass(frozen=True)
class ActionSample:
    """One action as sampled: its text (decoded for parsing only), ids and log-probs.

    ``behavior_logprobs`` are those of the distribution that actually produced the ids; a
    scripted source is deterministic given its observations and records 0.0 (probability 1)
    with ``finish="scripted"``, which the admission controller keeps out of RL updates.
    """

    text: str
    token_ids: list[int]
    behavior_logprobs: list[float]
    raw_logprobs: list[float] | None
    finish: GenerationFinish


class ActionSource(Protocol):
    """Produces actions for a set of live episodes, each with its own threaded context."""

    build: str

    def open(self, key: str, task_id: str, prompt_ids: list[int], observation: str,
             stream: int | None = None) -> None:
        """Start an episode whose context is ``prompt_ids``; ``stream`` (when given) seeds the
        episode's own sampling stream (a source without randomness ignores it)."""
        ...

    def extend(self, key: str, observation: str, observation_ids: list[int]) -> None:
        """Append an observation delta to an episode's context."""
        ...

    def act(self, keys: Sequence[str]) -> list[ActionSample]:
        """Sample one action for each live episode, together."""
        ...

    def close(self, key: str) -> None:
        """Forget an episode (free its cache)."""
        ...


class ScriptedPolicyLike(Protocol):
    """What ``closedloop.envs.scripted`` policies provide."""

    def act(self, observation: str) -> Action | str:
        """Return the next action (or raw text, possibly malformed on purpose)."""
        ...


class ScriptedSource:
    """Runs scripted policies (expert, noisy expert, random) through the collector.

    The action text is tokenized once, on its own, with ``encode`` (no special tokens added);
    the ids are what the demonstration trains on. ``stop_ids`` are appended so a scripted action
    ends the way a sampled one does.
    """

    def __init__(self, make_policy: Callable[[str, str], ScriptedPolicyLike],
                 encode: Callable[[str], list[int]], stop_ids: Sequence[int] = (),
                 build: str = "scripted") -> None:
        self.build = build
        self._make_policy = make_policy
        self._encode = encode
        self._stop_ids = list(stop_ids)
        self._policies: dict[str, ScriptedPolicyLike] = {}
        self._last_obs: dict[str, str] = {}

    def open(self, key: str, task_id: str, prompt_ids: list[int], observation: str,
             stream: int | None = None) -> None:
        """Create the episode's policy (``make_policy(task_id, key)``; ``stream`` unused: the
        policy's randomness is its own seed)."""
        self._policies[key] = self._make_policy(task_id, key)
        self._last_obs[key] = observation

    def extend(self, key: str, observation: str, observation_ids: list[int]) -> None:
        """Remember the observation the policy reacts to next."""
        self._last_obs[key] = observation

    def act(self, keys: Sequence[str]) -> list[ActionSample]:
        """Ask each episode's policy for its next action."""
        out = []
        for key in keys:
            action = self._policies[key].act(self._last_obs[key])
            text = action.model_text() if isinstance(action, Action) else action
            ids = self._encode(text) + self._stop_ids
            out.append(ActionSample(text, ids, [0.0] * len(ids), None, "scripted"))
        return out

    def close(self, key: str) -> None:
        """Drop the episode's policy."""
        self._policies.pop(key, None)
        self._last_obs.pop(key, None)


class BatchGenerator(Protocol):
    """The stateful batched generator API of ``closedloop.policy`` (KV reuse per session)."""

    def open_session(self, prompt_ids: list[int], stream: int | None = None) -> Any:
        """Start a session whose context is ``prompt_ids`` (``stream``: its own sampling
        stream's seed)."""
        ...

    def extend(self, session: Any, ids: list[int]) -> None:
        """Append ids to a session's context."""
        ...

    def generate_batch(self, sessions: Sequence[Any], sampler: SamplerConfig,
                       stop_sequences: Sequence[str] | None = None,
                       max_new_tokens: int = 256) -> list[Any]:
        """Sample one action per session; returns generations with ids and log-probs."""
        ...

    def close(self, session: Any) -> None:
        """Free a session."""
        ...

    def context(self, session: Any) -> list[int]:
        """The session's whole context ids."""
        ...

    def remaining(self, session: Any) -> int:
        """Ids that still fit in the session's context window."""
        ...

    def stream_state(self, session: Any) -> Any:
        """The state of the session's own sampling stream (``None`` without one)."""
        ...

    def set_stream_state(self, session: Any, state: Any) -> None:
        """Continue the session's sampling from a state ``stream_state`` returned."""
        ...


class GeneratorSource:
    """Samples actions from a language model through a batched generator."""

    def __init__(self, generator: BatchGenerator, decode: Callable[[list[int]], str],
                 sampler: SamplerConfig, max_new_tokens: int, build: str) -> None:
        self.build = build
        self._gen = generator
        self._decode = decode
        self._sampler = sampler
        self._max_new = max_new_tokens
        self._sessions: dict[str, Any] = {}
        self._suspended: dict[str, Any] = {}

    def open(self, key: str, task_id: str, prompt_ids: list[int], observation: str,
             stream: int | None = None) -> None:
        """Open a generator session on the rendered prompt (with its own sampling stream when
        ``stream`` is given)."""
        self._sessions[key] = self._gen.open_session(list(prompt_ids), stream)

    def extend(self, key: str, observation: str, observation_ids: list[int]) -> None:
        """Append the observation delta; only these ids are prefilled next time."""
        self._gen.extend(self._sessions[key], list(observation_ids))

    def act(self, keys: Sequence[str]) -> list[ActionSample]:
        """Generate one action for every live episode in one batch."""
        try:
            gens = self._gen.generate_batch([self._sessions[k] for k in keys], self._sampler,
                                            max_new_tokens=self._max_new)
        except ContextOverflowError as exc:
            over = set(exc.sessions)
            raise ContextBudgetExceeded([k for k in keys if self._sessions[k] in over]) from exc
        out = []
        for g in gens:
            ids = list(g.action_token_ids)
            raw = None if g.raw_model_logprobs is None else list(g.raw_model_logprobs)
            out.append(ActionSample(self._decode(ids), ids, list(g.behavior_logprobs), raw,
                                    g.finish_reason))
        return out

    def close(self, key: str) -> None:
        """Close the session, live or kept aside by ``suspend`` (frees its KV cache)."""
        session = self._sessions.pop(key, None) or self._suspended.pop(key, None)
        if session is not None:
            self._gen.close(session)

    def suspend(self, key: str) -> tuple[list[int], Any, int]:
        """Pause an episode: its exact context ids, its sampling stream's state and the ids
        left in the context window. The session is kept aside: resumed by this source under
        the same weights, it continues with its KV cache (which ``refresh_weights`` drops
        on any weight change)."""
        session = self._sessions.pop(key)
        self._suspended[key] = session
        return (self._gen.context(session), self._gen.stream_state(session),
                self._gen.remaining(session))

    def reopen(self, key: str, context_ids: list[int], stream_state: Any) -> None:
        """Resume a paused episode on its exact context ids: the kept-aside session when this
        source paused it and it holds those ids (its cache, if any survived, was computed by
        the weights held now), else a new session that prefills them under the weights held
        now, its sampling stream continued from ``stream_state``. A prefill rounds otherwise
        than a cached step, so a resume from the record alone can part from the
        uninterrupted episode at a near-tie token."""
        kept = self._suspended.pop(key, None)
        if kept is not None and self._gen.context(kept) == list(context_ids):
            self._sessions[key] = kept
            return
        if kept is not None:
            self._gen.close(kept)
        session = self._gen.open_session(list(context_ids))
        self._gen.set_stream_state(session, stream_state)
        self._sessions[key] = session
