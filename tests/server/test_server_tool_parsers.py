"""``rooflm serve --tool-call-parser mistral`` with the embedded default model, through the official openai client:
forced calls come out in Mistral's format and parse back into valid calls with Mistral's 9-character ids, streamed
and non-streamed calls agree, and calls in the history are written in Mistral's format."""
from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from server_helpers import API_KEY, HAVE_REAL_ENGINE, ServerProcess
from test_server_structured import ASK, CALL_TOKENS, TOOLS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mistral_server() -> Iterator[ServerProcess]:
    if not HAVE_REAL_ENGINE:
        pytest.skip("rooflm.engine.engine is not there yet")
    server = ServerProcess("--max-model-len", "640", "--max-num-seqs", "8", "--tool-call-parser", "mistral",
                           api_key=API_KEY)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def test_mistral_format_end_to_end(mistral_server: ServerProcess):
    c = openai.OpenAI(base_url=mistral_server.url + "/v1", api_key=API_KEY, timeout=180, max_retries=0)
    model = c.models.list().data[0].id
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    r = c.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required", n=3,
                                  temperature=1.0, seed=7, max_tokens=CALL_TOKENS)
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls", ch.message
        assert ch.message.content is None and len(ch.message.tool_calls) == 1
        call = ch.message.tool_calls[0]
        assert len(call.id) == 9 and call.id.isalnum()
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])

    kw = {"model": model, "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": CALL_TOKENS,
          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    full = c.chat.completions.create(**kw).choices[0]
    streamed: dict[int, list[str]] = {}
    content, finish = "", None
    for chunk in c.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            streamed.setdefault(tc.index, []).append((tc.function.name, tc.function.arguments))
        finish = chunk.choices[0].finish_reason or finish
    assert finish == full.finish_reason == "tool_calls" and content == ""
    assert [streamed[i][0] for i in sorted(streamed)] == [
        (t.function.name, t.function.arguments) for t in full.message.tool_calls]
    assert full.message.tool_calls[0].function.name == "get_weather"

    # A call in the history is rendered in the same format (the default model's template has no tool support).
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "abc123def", "type": "function",
         "function": {"name": "get_time", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "abc123def", "content": "12:00"}]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    tok = httpx.post(mistral_server.url + "/tokenize", headers=headers, json={"messages": history}, timeout=60).json()
    text = httpx.post(mistral_server.url + "/detokenize", headers=headers, json={"tokens": tok["tokens"]},
                      timeout=60).json()["prompt"]
    assert '[TOOL_CALLS] [{"name": "get_time", "arguments": {"city": "Paris"}}]' in text
    r = c.chat.completions.create(model=model, messages=history, tools=TOOLS, temperature=0, max_tokens=16)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
