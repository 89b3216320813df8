"""Property-based fuzz of request bodies: whatever the body, the server answers below 500 (valid → 200, invalid →
400/404 with the OpenAI error shape), streams end with [DONE], and the engine stays alive.

Each field draws from values of the right type around and beyond its valid range, and from junk of other types.
Generation lengths are kept tiny (max_tokens <= 4 when valid; chat always sends one) so valid examples stay cheap.
Run against the fake engine (many examples, fast) and against `rooflm serve` with the real default model.
"""
from __future__ import annotations

import json

import httpx
import pytest
from conftest import FakeServer, ServerProcess
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

_scalar_junk = st.one_of(
    st.booleans(),
    st.text(max_size=8),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.sampled_from([-1, 0, 2**64, -(2**70), 10**9, 49152, 1e308]),
)
JUNK = st.one_of(_scalar_junk, st.lists(_scalar_junk, max_size=3),
                 st.dictionaries(st.text(max_size=5), _scalar_junk, max_size=3))
NULL_OR_JUNK = st.one_of(st.none(), JUNK)


def either(valid: st.SearchStrategy, junk: st.SearchStrategy = NULL_OR_JUNK) -> st.SearchStrategy:
    return st.one_of(valid, valid, junk)  # valid values twice as likely


# Mostly the served model; sometimes another name, null or junk.
MODEL = st.one_of(st.just("__MODEL__"), st.just("__MODEL__"), st.just("__MODEL__"),
                  st.sampled_from(["other-model", None, ""]), JUNK)
SMALL_FLOAT = st.floats(-3, 3, allow_nan=False, width=32)
COMMON = {
    "temperature": either(st.floats(-0.5, 2.5, allow_nan=False)),
    "top_p": either(st.floats(-0.2, 1.2, allow_nan=False)),
    "n": either(st.integers(-1, 3)),
    "stop": either(st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=4))),
    "seed": either(st.integers(-(2**65), 2**65)),
    "presence_penalty": either(SMALL_FLOAT),
    "frequency_penalty": either(SMALL_FLOAT),
    "stream": either(st.booleans()),
    "stream_options": either(st.fixed_dictionaries({}, optional={"include_usage": either(st.booleans())})),
    "user": either(st.text(max_size=8)),
    "top_k": either(st.integers(-3, 60000)),
    "min_p": either(st.floats(-0.2, 1.2, allow_nan=False)),
    "repetition_penalty": either(st.floats(-1, 150, allow_nan=False)),
    "ignore_eos": either(st.booleans()),
    "min_tokens": either(st.integers(-1, 6)),
    "stop_token_ids": either(st.lists(st.integers(-3, 60000), max_size=3)),
    "skip_special_tokens": either(st.booleans()),
    "include_stop_str_in_output": either(st.booleans()),
    "logit_bias": either(st.dictionaries(st.text(max_size=3), SMALL_FLOAT, max_size=2)),
}
PROMPT = either(st.one_of(
    st.text(max_size=40),
    st.lists(st.integers(-3, 60000), max_size=8),
    st.lists(st.text(max_size=12), max_size=3),
    st.lists(st.lists(st.integers(0, 50000), max_size=4), max_size=3),
))
COMPLETION_BODY = st.fixed_dictionaries(
    {"model": MODEL},  # "__MODEL__" is replaced by the served id
    optional=COMMON | {
        "prompt": PROMPT,
        "max_tokens": either(st.integers(-2, 4)),
        "logprobs": either(st.integers(-1, 21)),
        "echo": either(st.booleans()),
        "best_of": either(st.integers(0, 3)),
        "suffix": either(st.text(max_size=3)),
    })
CONTENT = st.one_of(st.text(max_size=30), st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=10)}), max_size=2), st.none(), JUNK)
MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard"]), JUNK)},
    optional={"content": CONTENT, "name": either(st.text(max_size=5))})
CHAT_BODY = st.fixed_dictionaries(
    {"model": MODEL,
     # never absent or null: a chat request without a limit would generate up to max_model_len
     "max_tokens": st.one_of(st.integers(-1, 4), JUNK)},
    optional=COMMON | {
        "messages": either(st.lists(MESSAGE, max_size=4)),
        "max_completion_tokens": st.one_of(st.integers(-1, 4), JUNK),
        "logprobs": either(st.booleans()),
        "top_logprobs": either(st.integers(-1, 21)),
    })
RAW = st.one_of(st.binary(max_size=60), st.text(max_size=60).map(str.encode),
                st.sampled_from([b'{"prompt": "x", "max_tokens": 2, "temperature": NaN}', b'{"messages": [}',
                                 b'{"prompt": "x", "max_tokens": 2, "top_p": -Infinity}', b"[]", b"{}" * 3,
                                 b'{"prompt": "' + b"\\ud800" + b'", "max_tokens": 1}', b"[" * 5000]))


def _check(http: httpx.Client, path: str, body: dict | bytes, model: str) -> None:
    if isinstance(body, dict):
        if body.get("model") == "__MODEL__":
            body = body | {"model": model}
        content = json.dumps(body).encode()
    else:
        content = body
    wants_stream = isinstance(body, dict) and body.get("stream") is True
    with http.stream("POST", path, content=content, headers={"content-type": "application/json"}) as r:
        raw = r.read()
    assert r.status_code < 500, (r.status_code, raw[:500], body)
    if r.status_code != 200:
        assert r.status_code in (400, 404), (r.status_code, raw[:500], body)
        err = json.loads(raw)["error"]
        assert err["message"] and err["type"], body
        return
    text = raw.decode()
    if wants_stream:
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", (text[-300:], body)
        assert not any('"error"' in e[:10] for e in events), (text[-300:], body)
    else:
        out = json.loads(text)
        assert out["choices"] and out["usage"]["total_tokens"] >= out["usage"]["completion_tokens"], out


def _fuzz(server_url: str, headers: dict, model: str, examples: int) -> None:
    with httpx.Client(base_url=server_url, headers=headers, timeout=120) as http:
        common = dict(max_examples=examples, deadline=None, database=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                             HealthCheck.filter_too_much])

        @settings(**common)
        @given(COMPLETION_BODY)
        def completions(body: dict) -> None:
            _check(http, "/v1/completions", body, model)

        @settings(**common)
        @given(CHAT_BODY)
        def chat(body: dict) -> None:
            _check(http, "/v1/chat/completions", body, model)

        @settings(**(common | {"max_examples": max(10, examples // 2)}))
        @given(RAW, st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]))
        def raw(body: bytes, path: str) -> None:
            _check(http, path, body, model)

        completions()
        chat()
        raw()
        assert http.get("/health").status_code == 200  # the engine survived everything


def test_fuzz_request_bodies_fake_engine(shared_fake_server: FakeServer):
    _fuzz(shared_fake_server.url, shared_fake_server.headers, "fake-model", examples=150)


@pytest.mark.slow
def test_fuzz_request_bodies_real_server(real_server: ServerProcess):
    with real_server.client() as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
    _fuzz(real_server.url, real_server.headers, model, examples=40)
