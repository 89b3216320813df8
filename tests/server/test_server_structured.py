"""Structured output and tool calling through the official openai client against `rooflm serve` (the embedded
default model): JSON-schema / json_object / regex / choice outputs follow their constraint, forced tool calls are
always valid calls whose arguments validate, streamed and non-streamed calls agree, tool calls and tool results in
the history are accepted, and constraints the grammar engine refuses are a 400 naming the field."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from server_helpers import API_KEY, ServerProcess

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Za-z]{1,10}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"}},
                                               "required": ["city"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
# The longest forced call is about 110 characters: every call ends within this many tokens.
CALL_TOKENS = 128


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=180, max_retries=0)


def _model(c: openai.OpenAI) -> str:
    return c.models.list().data[0].id


def test_response_format_json_schema_and_json_object(real_server: ServerProcess):
    c = client(real_server)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = c.chat.completions.create(model=_model(c), messages=[{"role": "user", "content": "Invent a person."}],
                                  response_format=fmt, n=6, temperature=1.0, seed=3, max_tokens=48)
    assert len(r.choices) == 6
    for ch in r.choices:
        assert ch.finish_reason == "stop", ch.message.content
        jsonschema.validate(json.loads(ch.message.content), PERSON)
    r = c.chat.completions.create(model=_model(c), messages=[{"role": "user", "content": "Reply in JSON."}],
                                  response_format={"type": "json_object"}, temperature=0, max_tokens=64)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still the start of an object
        assert r.choices[0].message.content.startswith("{")


def test_response_format_on_completions(real_server: ServerProcess):
    c = client(real_server)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = c.completions.create(model=_model(c), prompt="A person as JSON:", n=4, temperature=1.0, seed=6,
                             max_tokens=48, extra_body={"response_format": fmt})
    assert len(r.choices) == 4
    for ch in r.choices:
        assert ch.finish_reason == "stop", ch.text
        jsonschema.validate(json.loads(ch.text), PERSON)
    chunks = list(c.completions.create(model=_model(c), prompt="A person as JSON:", temperature=0, max_tokens=48,
                                       stream=True, extra_body={"response_format": fmt}))
    jsonschema.validate(json.loads("".join(ch.choices[0].text for ch in chunks if ch.choices)), PERSON)
    r = c.completions.create(model=_model(c), prompt="Some JSON:", temperature=0, max_tokens=64,
                             extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:  # cut by max_tokens: still the start of an object
        assert r.choices[0].text.startswith("{")
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such"}}}
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=_model(c), prompt="x", max_tokens=4, extra_body={"response_format": bad})
    assert e.value.body["param"] == "response_format", e.value.body


def test_structured_outputs_extension_on_both_endpoints(real_server: ServerProcess):
    c = client(real_server)
    model = _model(c)
    regex = r"[A-Z][a-z]{1,5} [0-9]{2}"
    r = c.completions.create(model=model, prompt="A code:", n=5, temperature=1.0, seed=1, max_tokens=16,
                             extra_body={"structured_outputs": {"regex": regex}})
    for ch in r.choices:
        assert re.fullmatch(regex, ch.text) and ch.finish_reason == "stop", ch.text
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Is the sky blue?"}],
                                  n=4, temperature=1.0, seed=2, max_tokens=8,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert all(ch.message.content in ("yes", "no") for ch in r.choices)


def test_tool_choice_required_always_yields_a_valid_call(real_server: ServerProcess):
    c = client(real_server)
    r = c.chat.completions.create(model=_model(c), messages=ASK, tools=TOOLS, tool_choice="required", n=6,
                                  temperature=1.0, seed=4, max_tokens=CALL_TOKENS)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls", ch.message
        assert ch.message.content is None and len(ch.message.tool_calls) == 1
        call = ch.message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    named = c.chat.completions.create(model=_model(c), messages=ASK, tools=TOOLS, temperature=1.0, seed=5,
                                      tool_choice={"type": "function", "function": {"name": "get_time"}}, n=3,
                                      max_tokens=CALL_TOKENS)
    for ch in named.choices:
        call = ch.message.tool_calls[0]
        assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), schemas["get_time"])


def test_streamed_and_non_streamed_tool_calls_agree(real_server: ServerProcess):
    c = client(real_server)
    kw = dict(model=_model(c), messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,
              max_tokens=CALL_TOKENS)
    full = c.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in c.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = tc.id or entry["id"]
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == full.finish_reason == "tool_calls"
    assert content == (full.message.content or "")
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == [
        (t.function.name, t.function.arguments) for t in full.message.tool_calls]
    assert all(calls[i]["id"].startswith("call_") for i in calls)


def test_tool_calls_and_results_in_the_history_are_accepted(real_server: ServerProcess):
    c = client(real_server)
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    r = c.chat.completions.create(model=_model(c), messages=history, tools=TOOLS, temperature=0, max_tokens=24)
    ch = r.choices[0]
    assert ch.finish_reason in ("stop", "length", "tool_calls")
    assert ch.message.content or ch.message.tool_calls
    # The rendered prompt carries the call and its result (the template here has no tool support: the fallback).
    tok = httpx.post(real_server.url + "/tokenize", headers={"Authorization": f"Bearer {API_KEY}"},
                     json={"messages": history}, timeout=60).json()
    text = httpx.post(real_server.url + "/detokenize", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"tokens": tok["tokens"]}, timeout=60).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    assert '<tool_response>\n{"temperature": 21, "sky": "clear"}\n</tool_response>' in text


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such"}}}},
     "response_format"),
    ({"extra_body": {"structured_outputs": {"regex": "[a-"}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"grammar": "start: missing_rule"}}}, "structured_outputs"),
])
def test_constraints_the_engine_refuses_are_400_naming_the_field(real_server: ServerProcess, extra, param):
    c = client(real_server)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=_model(c), messages=ASK, max_tokens=4, **extra)
    assert e.value.body["param"] == param, e.value.body
