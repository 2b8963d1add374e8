"""Chat rendering on token ids: deltas, stops, hashes and the append-only check."""

from dataclasses import dataclass

from closedloop.contracts import Action
from closedloop.policy import (
    CHATML_TOOLS,
    ChatMessage,
    ChatMLToolTemplate,
    ChatRenderer,
    SampleTurn,
    check_append_only,
)

from .conftest import TOOLS


def test_prompt_and_observation_delta_text(renderer, tokenizer):
    prompt = renderer.render_prompt("Fix config.json.")
    text = tokenizer.decode(prompt)
    assert prompt[0] == renderer.im_start_id
    assert text.endswith("<|im_start|>user\nFix config.json.<|im_end|>\n<|im_start|>assistant\n")
    assert '\n- {"description":"Read a file.","name":"read_file"' in text  # full JSON schema
    delta = tokenizer.decode(renderer.render_observation("ok"))
    assert delta == ("<|im_end|>\n<|im_start|>user\n<tool_response>\nok\n</tool_response>"
                     "<|im_end|>\n<|im_start|>assistant\n")
    closed = tokenizer.decode(renderer.render_observation("ok", turn_closed=True))
    assert closed == delta[len("<|im_end|>"):]


def test_tools_block_lists_signatures_and_keeps_other_schemas_whole():
    from closedloop.policy.chat import tool_line

    assert tool_line({"name": "replace", "description": "Edit.", "parameters": {
        "path": "string", "old": "string", "count": "integer"}}) == (
        "- replace(path, old, count: integer): Edit.")
    assert tool_line({"name": "finish", "parameters": {}}) == "- finish()"
    nested = {"name": "search", "parameters": {"type": "object", "properties": {"q": {}}}}
    assert tool_line(nested) == '- {"name":"search","parameters":{"properties":{"q":{}},' \
        '"type":"object"}}'


def test_stops_and_action_text(renderer, tokenizer):
    assert renderer.stop_sequences == ("</tool_call>",)
    im_end = renderer.im_end_id
    assert im_end in renderer.stop_token_ids
    action = Action.tool("read_file", path="a.json").canonical_text()
    ids = [*renderer.encode(action), im_end]
    assert renderer.turn_closed(ids) and not renderer.turn_closed(ids[:-1])
    assert renderer.action_text(ids) == action


def test_threaded_ids_equal_whole_rendering_for_our_template(renderer):
    report = check_append_only(renderer)
    assert report.append_only, report.summary()
    assert report.text_equal and not report.mismatches and not report.seam_merges
    assert report.delta_len == report.full_len > 100


@dataclass(frozen=True)
class StripHistoryTemplate(ChatMLToolTemplate):
    """Deliberately NOT append-only: the whole rendering strips earlier assistant turns."""

    name: str = "strip-history-test"

    def render_messages(self, messages, add_generation_prompt):
        last = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=-1)
        cleaned = [ChatMessage(m.role, m.content.strip()) if m.role == "assistant" and i < last
                   else m for i, m in enumerate(messages)]
        return super().render_messages(cleaned, add_generation_prompt)


def test_non_append_only_template_is_reported(tokenizer):
    r = ChatRenderer(tokenizer, "sys", TOOLS, template=StripHistoryTemplate())
    report = check_append_only(r)
    assert not report.append_only and not report.text_equal
    first = report.mismatches[0]
    prompt_len = len(r.render_prompt("Repair config.json so that it parses as JSON.  "
                                     "Keep the key order.\n"))
    assert first.position == prompt_len  # the stripped leading space of the first action
    assert " I" in first.delta_snippet and "NOT append-only" in report.summary()
    assert r.template_hash() != CHATML_TOOLS.template_hash()


@dataclass(frozen=True)
class PlainSeamTemplate(ChatMLToolTemplate):
    """Observation deltas without special tokens at the seams: text is equal, BPE is not."""

    name: str = "plain-seams-test"

    def observation_text(self, observation, turn_closed):
        return f"Observation: {observation}\n"

    def render_messages(self, messages, add_generation_prompt):
        head = "".join(self.message_text(m) for m in messages[:2]) + self.assistant_header()
        body = "".join(m.content if m.role == "assistant" else f"Observation: {m.content}\n"
                       for m in messages[2:])
        return head + body


def test_seam_merges_are_reported(tokenizer):
    r = ChatRenderer(tokenizer, "sys", TOOLS, template=PlainSeamTemplate())
    turns = [SampleTurn('<tool_call>{"name": "finish"}</tool_call>', "done"),
             SampleTurn("I am done. ", "ok")]
    report = check_append_only(r, turns=turns)
    # seam 3: "I am done. " + "Observation" tokenizes " Observation" as one token
    assert report.text_equal and not report.append_only
    assert [s.seam for s in report.seam_merges] == [3]
    from closedloop.policy.chat import SAMPLE_TASK

    before = (r.render_prompt(SAMPLE_TASK) + r.encode(turns[0].action)
              + r.render_observation("done") + r.encode("I am done."))
    assert report.mismatches[0].position == len(before)  # where " " merged into " Observation"


def test_hashes_identify_prompt_tools_and_template(tokenizer):
    a = ChatRenderer(tokenizer, "sys", TOOLS)
    b = ChatRenderer(tokenizer, "sys", list(reversed(TOOLS)))
    c = ChatRenderer(tokenizer, "sys2", TOOLS)
    assert a.template_hash() == b.template_hash() == CHATML_TOOLS.template_hash()
    assert a.tool_schema_hash() != b.tool_schema_hash()
    assert a.system_prompt_hash() != c.system_prompt_hash()
    assert a.tool_schema_hash() == ChatRenderer(tokenizer, "x", [dict(t) for t in TOOLS]
                                                ).tool_schema_hash()
    assert a.template_hash().startswith("sha256:")
