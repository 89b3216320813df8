"""Tool calling helpers: parsing calls out of text, streaming them, the fallback rendering, template detection and
the forced-call grammar (checked by llguidance)."""
from __future__ import annotations

import json

import pytest

from rooflm.structured.backend import grammar_text
from rooflm.structured.params import StructuredOutputsParams
from rooflm.structured.tools import (ToolCallStream, fallback_messages, forced_call_grammar, parse_tool_calls,
                                     template_messages, template_supports_tools)

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "now"}}]
NAMES = frozenset({"add", "now"})
TEXT = ('Let me compute.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
        '<tool_call>\n{"name": "now", "arguments": "{}"}\n</tool_call>')


def test_parse_keeps_valid_calls_and_leaves_the_rest_as_content():
    content, calls = parse_tool_calls(TEXT, NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2}), ("now", {})]
    assert content == 'Let me compute.\n\n<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert parse_tool_calls("<tool_call>{not json}</tool_call> hi", NAMES) == (
        "<tool_call>{not json}</tool_call> hi", [])
    assert parse_tool_calls('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', NAMES)[1] == []


@pytest.mark.parametrize("step", [1, 3, 7, len(TEXT)])
def test_streamed_deltas_add_up_to_the_parsed_response(step):
    stream = ToolCallStream(NAMES)
    content, calls = "", []
    cuts = list(range(step, len(TEXT), step)) + [len(TEXT)]
    for end in cuts:
        delta, new = stream.feed(TEXT[:end], end == len(TEXT))
        content += delta
        calls += new
    expected_content, expected_calls = parse_tool_calls(TEXT, NAMES)
    assert content == expected_content
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (i, c.name, c.arguments) for i, c in enumerate(expected_calls)]


def test_stream_holds_back_a_possible_call_opening_only():
    stream = ToolCallStream(NAMES)
    assert stream.feed("Hi <tool_", False) == ("Hi ", [])
    assert stream.feed("Hi <tool_x", False) == ("<tool_x", [])
    assert stream.feed("Hi <tool_x", True) == ("", [])


def test_fallback_rendering_of_tools_calls_and_results():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    out = fallback_messages(msgs, TOOLS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and json.dumps(TOOLS[0]) in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert out[3]["content"] == "<tool_response>\n3\n</tool_response>"
    assert fallback_messages(msgs[1:2], TOOLS)[0]["role"] == "system"
    assert template_messages(msgs)[2]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}


def test_template_detection():
    class Tok:
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert not template_supports_tools(Tok())
    Tok.chat_template = "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{% endfor %}"
    assert template_supports_tools(Tok())
    Tok.chat_template = None
    assert not template_supports_tools(Tok())


def test_forced_call_grammar_compiles_and_refuses_unknown_names():
    import llguidance

    for name in (None, "add", "now"):
        g = grammar_text(StructuredOutputsParams(grammar=forced_call_grammar(TOOLS, name)))
        assert llguidance.LLMatcher.validate_grammar(g) == ""
    with pytest.raises(ValueError, match="'mul'"):
        forced_call_grammar(TOOLS, "mul")
