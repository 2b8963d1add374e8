"""The generator contract: context token ids + sampler -> action ids with both log-probs.

A ``Generator`` continues a context of token ids (never a string: token-id threading,
docs/concepts.md) and returns a ``Generation``: the sampled action ids, the behaviour log-prob of
each id under the distribution that actually sampled it (``closedloop.policy.sampling``), the raw
model log-prob of each id (temperature 1, no truncation), and why it stopped:

- ``"stop"``: the generated text contains a stop sequence (``</tool_call>``); the token that
  completed it is the last action id;
- ``"eos"``: the last action id is a stop token (``<|im_end|>`` or the tokenizer's EOS);
- ``"length"``: ``max_new_tokens`` ids were generated without a stop (the collector maps this to
  ``max_token_truncation``).

Stop tokens and the tokens that complete a stop sequence are part of the action ids, so the
trainer teacher-forces exactly what was sampled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple, Protocol, TypeVar, runtime_checkable

from closedloop.contracts import SamplerConfig
from closedloop.errors import ContextOverflowError, GenerationError

FinishReason = Literal["stop", "eos", "length"]
END_TOKENS = ("<|im_end|>", "<|endoftext|>")


class Generation(NamedTuple):
    """One sampled action: ids, behaviour and raw log-probs (same length), finish reason.

    ``raw_model_logprobs`` is None when the engine does not report them (a vLLM engine in
    processed mode samples only the sampler's distribution, unless asked to score the ids).
    """

    action_token_ids: list[int]
    behavior_logprobs: list[float]
    raw_model_logprobs: list[float] | None
    finish_reason: FinishReason


@runtime_checkable
class Generator(Protocol):
    """Anything that samples one action from a token-id context (HF, vLLM, scripted)."""

    @property
    def weight_checksum(self) -> str:
        """The checksum of the weights that sample (``weights_checksum`` / combined LoRA)."""
        ...

    def generate(self, context_token_ids: Sequence[int], sampler: SamplerConfig,
                 stop: Sequence[str], max_new_tokens: int, seed: int) -> Generation:
        """Sample one action continuing ``context_token_ids``; deterministic given ``seed``."""
        ...


class StopMatcher:
    """Detects the end of an action on the generated ids.

    ``check(ids)`` returns ``"eos"`` when ``ids[-1]`` is a stop token, ``"stop"`` when the text of
    the last ``window`` ids contains a stop sequence, else ``None``. The window is
    ``max(len(stop)) + 1`` ids: every token decodes to at least one character, so a stop string
    of n characters spans at most n tokens; called after every new id, the first match is the
    id that completed the stop sequence, however the model happened to tokenize it (``</`` +
    ``tool`` + ``_`` + ``call`` + ``>`` or any other split).
    """

    def __init__(self, tokenizer: Any, stop_sequences: Sequence[str],
                 stop_token_ids: Sequence[int]) -> None:
        if any(not s for s in stop_sequences):
            raise GenerationError("stop sequences must be non-empty strings")
        self.tokenizer = tokenizer
        self.stop_sequences = tuple(stop_sequences)
        self.stop_token_ids = frozenset(int(i) for i in stop_token_ids)
        self.window = max((len(s) for s in self.stop_sequences), default=0) + 1

    def check(self, ids: Sequence[int]) -> FinishReason | None:
        """Return the finish reason if ``ids`` (the action so far) ends the action."""
        if not ids:
            return None
        if ids[-1] in self.stop_token_ids:
            return "eos"
        if self.stop_sequences:
            tail = self.tokenizer.decode(list(ids[-self.window:]), skip_special_tokens=False)
            if any(s in tail for s in self.stop_sequences):
                return "stop"
        return None


def default_stop_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """Return the token stops of an action: the tokenizer's EOS, then ``<|im_end|>`` and
    ``<|endoftext|>`` when they are special tokens of this tokenizer (deduplicated, in order)."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    specials = set(tokenizer.all_special_tokens)
    ids += [int(tokenizer.convert_tokens_to_ids(t)) for t in END_TOKENS if t in specials]
    return tuple(dict.fromkeys(ids))


class _HasIds(Protocol):
    ids: list[int]


State = TypeVar("State", bound=_HasIds)


def session_state(table: Mapping[int, State], session: int) -> State:
    """A session generator's state of ``session``; ``GenerationError`` if it is unknown or
    closed."""
    try:
        return table[session]
    except KeyError:
        raise GenerationError(f"unknown or closed session {session}") from None


def batch_states(table: Mapping[int, State], sessions: Sequence[int], max_new: int,
                 max_context: int) -> list[State]:
    """The states of one ``generate_batch`` request, checked: distinct known sessions (at
    least one), ``max_new >= 1``, and ``ContextOverflowError`` naming every session whose
    context plus ``max_new`` ids would pass ``max_context``."""
    if not sessions or len(set(sessions)) != len(sessions):
        raise GenerationError("generate_batch needs distinct sessions, at least one")
    if max_new < 1:
        raise GenerationError("max_new_tokens must be >= 1")
    states = [session_state(table, s) for s in sessions]
    over = [sid for sid, st in zip(sessions, states, strict=True)
            if len(st.ids) + max_new > max_context]
    if over:
        raise ContextOverflowError(over, max_context)
    return states
