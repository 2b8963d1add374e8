"""Chat rendering that threads token ids (docs/concepts.md, token-id threading).

SmolLM2's own chat template has no tool role, so closedloop renders its own documented ChatML
tool format with the model's special tokens. The whole conversation, rendered at once, is::

    <|im_start|>system\\n{system prompt}\\n\\n{tools block}<|im_end|>\\n
    <|im_start|>user\\n{task text}<|im_end|>\\n
    <|im_start|>assistant\\n{action 0}<|im_end|>\\n
    <|im_start|>user\\n<tool_response>\\n{observation 0}\\n</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n{action 1}<|im_end|>\\n ...
    <|im_start|>assistant\\n

The rollout never re-renders it. Turn 0's prompt ids are ``render_prompt(task)`` (everything up
to and including the first assistant header); after each action the delta
``render_observation(obs)`` is tokenized once, on its own, and appended::

    <|im_end|>\\n<|im_start|>user\\n<tool_response>\\n{obs}\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n

**Action stop.** Generation stops when the generated text contains ``</tool_call>`` (stop
reason ``"stop"``), or at ``<|im_end|>``/EOS (``"eos"``), or at the token budget (``"length"``).
The stop tokens are part of the action ids, so the trainer teacher-forces exactly what was
sampled. An action that stopped on ``</tool_call>`` leaves the assistant turn open and the delta
starts with ``<|im_end|>``; an action that ended with ``<|im_end|>`` itself already closed the
turn, and the delta (``turn_closed=True``) starts with the ``\\n`` after it. Either way the
threaded ids spell the whole-conversation text above. Every seam between segments sits next to a
special token, which BPE never merges across, so delta tokenization equals whole tokenization;
``check_append_only`` verifies this (and reports seam merges) for any template. Action ids stay
as sampled: the model may emit a non-canonical split (``</`` ``tool`` ... instead of what
``encode`` would give), which is one more reason nothing downstream re-tokenizes text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from closedloop.contracts import TOOL_CALL_CLOSE, canonical_json, content_hash, sha256_hex
from closedloop.errors import ChatTemplateError
from closedloop.policy.generator import default_stop_token_ids

ToolSchema = dict[str, Any]


class ChatMessage(NamedTuple):
    """One message of a whole-conversation rendering: role (system/user/assistant/tool), text."""

    role: str
    content: str


@dataclass(frozen=True)
class ChatMLToolTemplate:
    """The ChatML tool format (module doc). Fields are the literal strings, hashed whole.

    The tools block lists one tool per line as a signature, ``- name(a, b: integer): what it
    does`` (a parameter's type is shown unless it is ``string``); a schema whose ``parameters``
    is not such a flat name -> type mapping is shown as its canonical JSON instead. On the
    terminal tools the block is about half as long as their JSON schemas (~120 ids fewer in
    every prompt).
    """

    name: str = "chatml-tools-v2"
    im_start: str = "<|im_start|>"
    im_end: str = "<|im_end|>"
    observation_role: str = "user"
    observation_open: str = "<tool_response>\n"
    observation_close: str = "\n</tool_response>"
    tools_intro: str = (
        "# Tools\n\nCall one tool per turn, as "
        '<tool_call>{{"name": <tool name>, "arguments": <JSON object>}}</tool_call>:\n'
        "{tools}\nWhen the task is done, call finish."
    )

    def system_content(self, system_prompt: str, tool_schemas: Sequence[ToolSchema]) -> str:
        """Return the system message: the prompt, a blank line, the tools block."""
        tools = "\n".join(tool_line(s) for s in tool_schemas)
        return f"{system_prompt}\n\n{self.tools_intro.format(tools=tools)}"

    def message_text(self, message: ChatMessage) -> str:
        """Return one whole message, ``<|im_start|>role\\ncontent<|im_end|>\\n``."""
        role, content = message
        if role == "tool":
            role = self.observation_role
            content = f"{self.observation_open}{content}{self.observation_close}"
        return f"{self.im_start}{role}\n{content}{self.im_end}\n"

    def render_messages(self, messages: Sequence[ChatMessage], add_generation_prompt: bool) -> str:
        """Render a whole conversation at once (the reference the deltas must reproduce)."""
        text = "".join(self.message_text(m) for m in messages)
        return text + (self.assistant_header() if add_generation_prompt else "")

    def assistant_header(self) -> str:
        """Return the header that opens an assistant turn."""
        return f"{self.im_start}assistant\n"

    def prompt_text(self, system_prompt: str, tool_schemas: Sequence[ToolSchema],
                    task_text: str) -> str:
        """Return turn 0's prompt: system + user messages + the assistant header."""
        messages = [ChatMessage("system", self.system_content(system_prompt, tool_schemas)),
                    ChatMessage("user", task_text)]
        return self.render_messages(messages, add_generation_prompt=True)

    def observation_text(self, observation: str, turn_closed: bool) -> str:
        """Return the delta after an action: close the turn, the observation, the next header."""
        close = "\n" if turn_closed else f"{self.im_end}\n"
        body = self.message_text(ChatMessage("tool", observation))
        return close + body + self.assistant_header()

    def template_hash(self) -> str:
        """Return the content hash of the template (its class and every literal string)."""
        return content_hash({"class": type(self).__name__, **asdict(self)})


def tool_line(schema: ToolSchema) -> str:
    """One tool of the tools block: ``- name(params): description`` (``ChatMLToolTemplate``)."""
    params = schema.get("parameters", {})
    if not isinstance(params, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in params.items()):
        return f"- {canonical_json(schema)}"
    args = ", ".join(k if v == "string" else f"{k}: {v}" for k, v in params.items())
    description = schema.get("description")
    tail = f": {description}" if isinstance(description, str) and description else ""
    return f"- {schema['name']}({args}){tail}"


CHATML_TOOLS = ChatMLToolTemplate()


class ChatRenderer:
    """Renders turn 0's prompt and each observation delta to token ids, each tokenized once.

    ``tokenizer`` must know ``<|im_start|>`` and ``<|im_end|>`` as special tokens.
    """

    def __init__(self, tokenizer: Any, system_prompt: str, tool_schemas: Sequence[ToolSchema],
                 template: ChatMLToolTemplate = CHATML_TOOLS) -> None:
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.tool_schemas = [json.loads(canonical_json(s)) for s in tool_schemas]
        self.template = template
        self.im_end_id = _special_id(tokenizer, template.im_end)
        self.im_start_id = _special_id(tokenizer, template.im_start)

    def encode(self, text: str) -> list[int]:
        """Tokenize ``text`` on its own (special-token strings map to their ids; no BOS added)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def render_prompt(self, task_text: str) -> list[int]:
        """Return turn 0's prompt ids (system with tools, user task, assistant header)."""
        return self.encode(self.template.prompt_text(self.system_prompt, self.tool_schemas,
                                                     task_text))

    def render_observation(self, observation_text: str, *, turn_closed: bool = False) -> list[int]:
        """Return the observation delta ids; ``turn_closed`` when the action ended in <|im_end|>."""
        return self.encode(self.template.observation_text(observation_text, turn_closed))

    def turn_closed(self, action_ids: Sequence[int]) -> bool:
        """Say whether an action's ids already closed the assistant turn (last id <|im_end|>)."""
        return bool(action_ids) and action_ids[-1] == self.im_end_id

    def action_text(self, action_ids: Sequence[int]) -> str:
        """Decode an action for parsing: its text without a trailing <|im_end|>/EOS token."""
        ids = list(action_ids)
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        """Text stops of an action: ``("</tool_call>",)``."""
        return (TOOL_CALL_CLOSE,)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Token stops of an action (``generator.default_stop_token_ids``) plus <|im_end|>."""
        return tuple(dict.fromkeys((*default_stop_token_ids(self.tokenizer), self.im_end_id)))

    def messages(self, task_text: str, turns: Sequence[tuple[str, str]]) -> list[ChatMessage]:
        """Return the whole conversation as messages: (action text, observation) per turn."""
        out = [ChatMessage("system", self.template.system_content(self.system_prompt,
                                                                  self.tool_schemas)),
               ChatMessage("user", task_text)]
        for action, observation in turns:
            out += [ChatMessage("assistant", action), ChatMessage("tool", observation)]
        return out

    def template_hash(self) -> str:
        """Return the chat-template hash for ``PolicyManifest.chat_template_hash``."""
        return self.template.template_hash()

    def system_prompt_hash(self) -> str:
        """Return ``sha256`` of the system prompt text."""
        return sha256_hex(self.system_prompt)

    def tool_schema_hash(self) -> str:
        """Return the content hash of the tool schemas (a list, order kept)."""
        return content_hash(self.tool_schemas)

    def manifest_hashes(self) -> dict[str, str]:
        """Return the renderer's ``PolicyManifest`` fields (system prompt, template, tools)."""
        return {"system_prompt_hash": self.system_prompt_hash(),
                "chat_template_hash": self.template_hash(),
                "tool_schema_hash": self.tool_schema_hash()}


def _special_id(tokenizer: Any, token: str) -> int:
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        raise ChatTemplateError(f"tokenizer has no single special token for {token!r}")
    return int(ids[0])


class SampleTurn(NamedTuple):
    """One turn of a sample conversation: action text, observation, action closed by <|im_end|>."""

    action: str
    observation: str
    closed: bool = False


SAMPLE_TASK = "Repair config.json so that it parses as JSON.  Keep the key order.\n"
SAMPLE_TURNS: tuple[SampleTurn, ...] = (
    SampleTurn(' I will read the file first.\n<tool_call>{"name": "read_file", "arguments": '
               '{"path": "config.json"}}</tool_call>', '{"a": 1,, "b": [2 ,3]}\n'),
    SampleTurn('<tool_call>{"arguments":{"content":"{\\"a\\": 1}","path":"config.json"},'
               '"name":"write_file"}</tool_call>\n', "wrote 9 bytes >"),
    SampleTurn("The file looks valid now.  ", "error: no tool call found\n\n", closed=True),
    SampleTurn('<tool_call>{"name": "finish"}</tool_call>', "  \u00e9t\u00e9 \u2713 "),
)


class TokenMismatch(NamedTuple):
    """A position where the threaded (delta) ids differ from the whole-conversation ids."""

    position: int
    delta_id: int | None
    full_id: int | None
    delta_snippet: str
    full_snippet: str


class SeamMerge(NamedTuple):
    """A seam where ``encode(a + b) != encode(a) + encode(b)`` (BPE merged across it)."""

    seam: int
    left_tail: str
    right_head: str


@dataclass(frozen=True)
class TemplateReport:
    """Result of ``check_append_only``: equal iff ``append_only``; differences are listed."""

    template_hash: str
    append_only: bool
    text_equal: bool
    delta_len: int
    full_len: int
    mismatches: tuple[TokenMismatch, ...]
    seam_merges: tuple[SeamMerge, ...]

    def summary(self) -> str:
        """Return a one-paragraph human-readable account."""
        if self.append_only and not self.seam_merges:
            return f"append-only: {self.delta_len} threaded ids equal the whole rendering"
        lines = [f"NOT append-only: {self.delta_len} threaded ids vs {self.full_len} whole "
                 f"(text equal: {self.text_equal})"]
        lines += [f"  token {m.position}: delta {m.delta_snippet!r} vs whole {m.full_snippet!r}"
                  for m in self.mismatches]
        lines += [f"  seam {s.seam} merges: {s.left_tail!r} | {s.right_head!r}"
                  for s in self.seam_merges]
        return "\n".join(lines)


def check_append_only(renderer: ChatRenderer, task_text: str = SAMPLE_TASK,
                      turns: Sequence[SampleTurn] = SAMPLE_TURNS,
                      max_mismatches: int = 5) -> TemplateReport:
    """Compare delta-threaded ids with the whole conversation rendered and tokenized at once.

    The threaded ids are ``render_prompt(task) + Σ_t [encode(action_t) (+ <|im_end|> if closed)
    + render_observation(obs_t)]``; the whole ids are ``encode(template.render_messages(...))``.
    Any differing position is reported with decoded snippets; every seam whose two segments
    merge under BPE is reported too (a merge there means a sampler and a re-tokenizing trainer
    would disagree even when the texts are equal).
    """
    tpl = renderer.template
    segments = [tpl.prompt_text(renderer.system_prompt, renderer.tool_schemas, task_text)]
    for turn in turns:
        segments.append(turn.action + (tpl.im_end if turn.closed else ""))
        segments.append(tpl.observation_text(turn.observation, turn.closed))
    delta_ids = [i for seg in segments for i in renderer.encode(seg)]
    pairs = [(t.action, t.observation) for t in turns]
    full_text = tpl.render_messages(renderer.messages(task_text, pairs), True)
    full_ids = renderer.encode(full_text)
    mismatches = _mismatches(renderer, delta_ids, full_ids, max_mismatches)
    merges = tuple(
        SeamMerge(i, segments[i][-16:], segments[i + 1][:16])
        for i in range(len(segments) - 1)
        if renderer.encode(segments[i] + segments[i + 1])
        != renderer.encode(segments[i]) + renderer.encode(segments[i + 1]))
    return TemplateReport(template_hash=renderer.template_hash(),
                          append_only=delta_ids == full_ids,
                          text_equal="".join(segments) == full_text,
                          delta_len=len(delta_ids), full_len=len(full_ids),
                          mismatches=mismatches, seam_merges=merges)


def _mismatches(renderer: ChatRenderer, delta: list[int], full: list[int],
                limit: int) -> tuple[TokenMismatch, ...]:
    out: list[TokenMismatch] = []
    for pos in range(max(len(delta), len(full))):
        a = delta[pos] if pos < len(delta) else None
        b = full[pos] if pos < len(full) else None
        if a == b:
            continue
        lo, hi = max(0, pos - 3), pos + 4
        dec = renderer.tokenizer.decode
        out.append(TokenMismatch(pos, a, b, dec(delta[lo:hi]), dec(full[lo:hi])))
        if len(out) >= limit:
            break
    return tuple(out)
