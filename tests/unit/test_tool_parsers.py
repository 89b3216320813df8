"""Tool-call formats other than Hermes (Llama 3.x JSON, Mistral): parsing, streamed deltas that add up to the
parsed response, the history / fallback-prompt rendering that parses back, the forced-call grammars (checked by
llguidance) and picking the format from a model's chat template and vocabulary."""
from __future__ import annotations

import json

import pytest

from rooflm.structured.backend import grammar_text
from rooflm.structured.params import StructuredOutputsParams
from rooflm.structured.tool_parsers import (
    PARSERS,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    detect_tool_parser,
    get_tool_parser,
)
from rooflm.structured.tools import fallback_messages

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "now"}}]
NAMES = frozenset({"add", "now"})


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}', "", [("add", {"a": 1, "b": 2})]),
    ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', "", [("add", {"a": 1, "b": 2})]),
    (' {"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}; {"name": "now", "parameters": {}} ', "",
     [("add", {"a": 3, "b": 4}), ("now", {})]),
    ('{"name": "now"}', "", [("now", {})]),
    ('The answer is {"name": "add"}', 'The answer is {"name": "add"}', []),  # a call is the whole message
    ('{"name": "mul", "parameters": {}}', '{"name": "mul", "parameters": {}}', []),  # not one of the tools
    ('{"name": "add", "parameters": [1, 2]}', '{"name": "add", "parameters": [1, 2]}', []),  # arguments not an object
    ('{"name": "add", "parameters": {"a": 1}} and more', '{"name": "add", "parameters": {"a": 1}} and more', []),
    ('{"name": "add", "parameters": {"a": 1', '{"name": "add", "parameters": {"a": 1', []),  # cut short
])
def test_llama3_json_parse(text, content, calls):
    got_content, got = Llama3JsonParser().parse(text, NAMES)
    assert (got_content, _calls(got)) == (content, calls)
    assert all(c.id.startswith("call_") for c in got)


@pytest.mark.parametrize("text, content, calls", [
    ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}]', "", [("add", {"a": 1, "b": 2})]),
    ('Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "now", "arguments": {}}]',
     "Sure. ", [("add", {"a": 1, "b": 2}), ("now", {})]),
    ('[TOOL_CALLS]add[ARGS]{"a": 5, "b": 6}[TOOL_CALLS]now[ARGS]{}', "", [("add", {"a": 5, "b": 6}), ("now", {})]),
    ('[{"name": "now", "arguments": {}}]', "", [("now", {})]),  # the marker dropped with the special tokens
    ('[TOOL_CALLS] {"name": "now", "arguments": {}}', "", [("now", {})]),  # one object, not in an array
    ('[TOOL_CALLS] [{"name": "mul", "arguments": {}}]', '[TOOL_CALLS] [{"name": "mul", "arguments": {}}]', []),
    ('[TOOL_CALLS] [{"name": "now", "arguments": {}}', '[TOOL_CALLS] [{"name": "now", "arguments": {}}', []),
    ('[TOOL_CALLS]now[ARGS]{"x": ', '[TOOL_CALLS]now[ARGS]{"x": ', []),
    ("[1, 2] are numbers", "[1, 2] are numbers", []),
    ("no calls here", "no calls here", []),
])
def test_mistral_parse(text, content, calls):
    got_content, got = MistralParser().parse(text, NAMES)
    assert (got_content, _calls(got)) == (content, calls)
    assert all(len(c.id) == 9 and c.id.isalnum() for c in got)  # Mistral's templates require such ids


STREAM_CASES = [
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "now", "parameters": {}}'),
    ("llama3_json", "  Paris is sunny today {not a call}"),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1'),
    ("mistral", 'Let me check. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}]'),
    ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 5, "b": 6}[TOOL_CALLS]now[ARGS]{}'),
    ("mistral", "An [unclosed bracket] and a [TOOL_CALLS] that is not JSON"),
    ("mistral", '\n[{"name": "now", "arguments": {}}]'),
    ("hermes", 'Hi <tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'),
]


@pytest.mark.parametrize("name, text", STREAM_CASES)
@pytest.mark.parametrize("step", [1, 4, 11, 1000])
def test_streamed_deltas_add_up_to_the_parsed_response(name, text, step):
    parser = get_tool_parser(name)
    stream = parser.stream(NAMES)
    content, calls = "", []
    cuts = list(range(step, len(text), step)) + [len(text)]
    for end in cuts:
        delta, new = stream.feed(text[:end], end == len(text))
        content += delta
        calls += new
    expected_content, expected_calls = parser.parse(text, NAMES)
    assert content == (expected_content if expected_content.strip() or not expected_calls else "")
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (i, c.name, json.loads(c.arguments)) for i, c in enumerate(expected_calls)]
    assert bool(stream.calls) == bool(expected_calls)


def test_streams_content_before_a_possible_call_and_holds_the_rest():
    s = MistralParser().stream(NAMES)
    assert s.feed("Sure [TOOL", False) == ("Sure ", [])
    assert s.feed("Sure [TOOL_CALLS] [", False) == ("", [])
    s = Llama3JsonParser().stream(NAMES)
    assert s.feed("  ", False) == ("", [])  # leading whitespace: maybe a call follows
    assert s.feed("  <|pyth", False) == ("", [])
    assert s.feed("  <|pyx", False) == ("  <|pyx", [])  # not the tag: plain content, streamed at once
    assert s.feed("  <|pyx {", False) == (" {", [])


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_history_calls_in_the_fallback_parse_back(name):
    parser = get_tool_parser(name)
    history = [{"role": "user", "content": "1+2? and the time"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}},
                   {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]}]
    out = fallback_messages(history, TOOLS, parser)
    assert out[0]["role"] == "system" and parser.instructions in out[0]["content"]
    content, calls = parser.parse(out[2]["content"], NAMES)
    assert content.strip() == "" and _calls(calls) == [("add", {"a": 1, "b": 2}), ("now", {})]


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_forced_call_grammars_compile_and_their_outputs_parse(name):
    import llguidance

    parser = get_tool_parser(name)
    for function in (None, "add", "now"):
        g = grammar_text(StructuredOutputsParams(grammar=parser.forced_call_grammar(TOOLS, function)))
        assert llguidance.LLMatcher.validate_grammar(g) == ""
    with pytest.raises(ValueError, match="'mul'"):
        parser.forced_call_grammar(TOOLS, "mul")
    # What the grammar allows (json.dumps' layout around one call object) parses as that call.
    forced = {"hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
              "llama3_json": '{"name": "add", "parameters": {"a": 1, "b": 2}}',
              "mistral": '[{"name": "add", "arguments": {"a": 1, "b": 2}}]'}[name]
    assert _calls(parser.parse(forced, NAMES)[1]) == [("add", {"a": 1, "b": 2})]


def test_unknown_parser_is_a_value_error_naming_the_choices():
    with pytest.raises(ValueError, match="tool_call_parser='pythonic'.*hermes, llama3_json, mistral"):
        get_tool_parser("pythonic")


class _Tok:
    def __init__(self, template, vocab=()):
        self.chat_template = template
        self._vocab = {t: i for i, t in enumerate(vocab)}

    def get_vocab(self):
        return self._vocab


@pytest.mark.parametrize("tok, expected", [
    (_Tok("{% for t in tools %}<tool_call>{% endfor %}"), "hermes"),
    (_Tok("{% if tools %}[AVAILABLE_TOOLS]{% endif %}{{ '[TOOL_CALLS]' }}"), "mistral"),
    (_Tok({"default": "x", "tool_use": "{{ '<|python_tag|>' }}"}), "llama3_json"),
    (_Tok('Respond in the format {"name": function name, "parameters": dictionary}'), "llama3_json"),
    (_Tok("{{ m.content }}", vocab=["a", "[TOOL_CALLS]"]), "mistral"),
    (_Tok("{{ m.content }}", vocab=["a", "<|python_tag|>"]), "llama3_json"),
    (_Tok(None, vocab=["<|im_start|>"]), "hermes"),
    (None, "hermes"),
])
def test_detect_from_template_then_vocabulary(tok, expected):
    assert detect_tool_parser(tok) == expected


def test_hermes_parser_is_the_tools_module_format():
    parser = HermesParser()
    text = 'x <tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    assert parser.hold_from(text) == 2
    content, calls = parser.parse(text, NAMES)
    assert content == "x " and _calls(calls) == [("now", {})]
