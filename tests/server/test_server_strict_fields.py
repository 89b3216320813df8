"""No silent ignoring: every request field either takes effect or is a 400 naming it; the accepted no-op fields are
exactly the documented bookkeeping ones; union-typed fields report the limit actually violated."""
from __future__ import annotations

import pytest
from server_helpers import FakeServer
from test_server_api_fake import assert_error

from rooflm.server.protocol import MAX_STOP, NO_OP_FIELDS

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}


@pytest.mark.parametrize("path,base", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize("field", ["frobnicate", "functions", "function_call", "modalities", "audio", "prediction"])
def test_unknown_fields_are_400_naming_them(shared_fake_server: FakeServer, path, base, field):
    with shared_fake_server.client() as c:
        err = assert_error(c.post(path, json={**base, field: 1}), 400, field)
    assert "unknown field" in err["message"] and field in err["message"]


def test_chat_only_and_completion_only_fields_are_400_on_the_other_endpoint(shared_fake_server: FakeServer):
    with shared_fake_server.client() as c:
        assert_error(c.post("/v1/chat/completions", json={**CHAT, "echo": True}), 400, "echo")
        assert_error(c.post("/v1/chat/completions", json={**CHAT, "suffix": "x"}), 400, "suffix")
        assert_error(c.post("/v1/completions", json={**COMPLETION, "messages": []}), 400, "messages")
        bad_message = {"messages": [{"role": "assistant", "content": "x", "tool_calls": []}]}
        assert_error(c.post("/v1/chat/completions", json=bad_message), 400, "messages")


def test_documented_no_op_fields_are_accepted(shared_fake_server: FakeServer):
    values = {"user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"}
    assert set(values) == set(NO_OP_FIELDS)
    with shared_fake_server.client() as c:
        plain = c.post("/v1/completions", json={**COMPLETION, "temperature": 0}).json()["choices"][0]["text"]
        for path, base in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            r = c.post(path, json={**base, "temperature": 0, **values})
            assert r.status_code == 200, r.text
        same = c.post("/v1/completions", json={**COMPLETION, "temperature": 0, **values}).json()
        assert same["choices"][0]["text"] == plain
        assert_error(c.post("/v1/completions", json={**COMPLETION, "store": True}), 400, "store")


def test_malformed_structured_output_and_tool_fields_are_400_naming_them(shared_fake_server: FakeServer):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    bad = [({"response_format": {"type": "xml"}}, "response_format"),
           ({"response_format": {"type": "json_schema"}}, "response_format"),
           ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format"),
           ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
           ({"structured_outputs": {"choice": []}}, "structured_outputs"),
           ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
           ({"tools": [tool, tool]}, "tools"),
           ({"tool_choice": "required"}, "tool_choice"),
           ({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
           ({"tools": [tool], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
           ({"tools": [tool], "tool_choice": "sometimes"}, "tool_choice")]
    with shared_fake_server.client() as c:
        for extra, param in bad:
            assert_error(c.post("/v1/chat/completions", json={**CHAT, **extra}), 400, param)
        assert_error(c.post("/v1/completions", json={**COMPLETION, "structured_outputs": {"regex": ""}}), 400,
                     "structured_outputs")
        for extra, param in bad[:3]:  # response_format is validated the same way on completions
            assert_error(c.post("/v1/completions", json={**COMPLETION, **extra}), 400, param)
        assert_error(c.post("/v1/completions", json={**COMPLETION, "max_tokens": 0, "echo": True,
                                                      "response_format": {"type": "json_object"}}),
                     400, "response_format")
        for ok in ({"response_format": {"type": "text"}}, {"response_format": {"type": "json_object"}}):
            r = c.post("/v1/completions", json={**COMPLETION, **ok})
            assert r.status_code == 200, (ok, r.text)
        for ok in ({"response_format": {"type": "text"}}, {"tool_choice": "none"}, {"tools": []},
                   {"parallel_tool_calls": False}, {"response_format": {"type": "json_object"}},
                   {"tools": [tool], "tool_choice": "none"}):
            r = c.post("/v1/chat/completions", json={**CHAT, **ok})
            assert r.status_code == 200, (ok, r.text)


def test_union_fields_report_the_violated_limit(shared_fake_server: FakeServer):
    with shared_fake_server.client() as c:
        err = assert_error(c.post("/v1/completions", json={**COMPLETION, "stop": ["x"] * (MAX_STOP + 1)}), 400, "stop")
        assert f"at most {MAX_STOP}" in err["message"] and "valid string" not in err["message"]
        err = assert_error(c.post("/v1/completions", json={**COMPLETION, "stop": ["a", ""]}), 400, "stop")
        assert "at least 1" in err["message"] and "valid string" not in err["message"]
        err = assert_error(c.post("/v1/completions", json={"prompt": [5, -1]}), 400, "prompt")
        assert "greater than or equal to 0" in err["message"]
        err = assert_error(c.post("/v1/completions", json={"prompt": ["ok", ""]}), 400, "prompt")
        assert "at least 1" in err["message"] and "valid string" not in err["message"]
        err = assert_error(c.post("/v1/chat/completions", json={"messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}] * 300}]}), 400, "messages")
        assert "at most 256" in err["message"]


def test_new_numeric_fields_are_range_checked(shared_fake_server: FakeServer):
    with shared_fake_server.client() as c:
        assert_error(c.post("/v1/completions", json={**COMPLETION, "prompt_logprobs": 21}), 400, "prompt_logprobs")
        assert_error(c.post("/v1/completions", json={**COMPLETION, "max_tokens": -1}), 400, "max_tokens")
        assert_error(c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 0}), 400, "max_tokens")
        assert_error(c.post("/v1/completions", json={**COMPLETION, "max_tokens": 0, "echo": True, "stream": True}),
                     400, "max_tokens")
