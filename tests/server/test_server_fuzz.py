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
from server_helpers import FakeServer, ServerProcess
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

_scalar_junk = st.one_of(
    st.booleans(),
    st.text(max_size=8),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.sampled_from([-1, 0, 2**64, -(2**70), 10**9, 49152, 1e308]),
)
JUNK = st.one_of(st.none(), _scalar_junk, st.lists(_scalar_junk, max_size=3),
                 st.dictionaries(st.text(max_size=5), _scalar_junk, max_size=3))
TEXT = st.text(min_size=1, max_size=12)
TOKEN = st.integers(0, 49151)  # the default model's vocabulary


def floats(lo: float, hi: float) -> st.SearchStrategy:
    return st.floats(lo, hi, allow_nan=False)


# Valid values (by the server's rules) of each optional field ...
VALID = {
    "temperature": floats(0, 2),
    "top_p": floats(0.01, 1),
    "n": st.integers(1, 3),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=4)),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "presence_penalty": floats(-2, 2),
    "frequency_penalty": floats(-2, 2),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "user": TEXT,
    "top_k": st.integers(-1, 60000),
    "min_p": floats(0, 1),
    "repetition_penalty": floats(0.01, 100),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 2),
    "stop_token_ids": st.lists(st.integers(0, 60000), max_size=3),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
}
# ... and invalid ones: beyond the range, or of another type.
INVALID = {
    "model": st.one_of(st.sampled_from(["other-model", ""]), JUNK),
    "temperature": st.one_of(floats(-5, -0.01), floats(2.01, 1e6), JUNK),
    "top_p": st.one_of(floats(-1, 0), floats(1.01, 5), JUNK),
    "n": st.one_of(st.integers(-5, 0), st.integers(17, 10**6), JUNK),
    "stop": st.one_of(st.just(""), st.lists(TEXT, min_size=17, max_size=20), JUNK),
    "seed": st.one_of(st.integers(2**64, 2**80), JUNK),
    "presence_penalty": st.one_of(floats(2.01, 100), JUNK),
    "top_k": st.one_of(st.integers(-100, -2), JUNK),
    "min_p": st.one_of(floats(1.01, 10), JUNK),
    "repetition_penalty": st.one_of(floats(-5, 0), JUNK),
    "min_tokens": st.one_of(st.integers(5, 100), JUNK),
    "stop_token_ids": st.one_of(st.lists(st.integers(-10, -1), min_size=1, max_size=2), JUNK),
    "stream": JUNK,
    "stream_options": JUNK,
    "logit_bias": st.one_of(st.dictionaries(TEXT, floats(-5, 5), min_size=1, max_size=2), JUNK),
    "max_tokens": st.one_of(st.integers(-3, 0), st.integers(600, 10**9), JUNK),
}
PROMPTS = st.one_of(
    st.text(min_size=1, max_size=40),
    st.lists(TOKEN, min_size=1, max_size=8),
    st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=3),
    st.lists(st.lists(TOKEN, min_size=1, max_size=4), min_size=1, max_size=3),
)
COMPLETION_VALID = VALID | {"logprobs": st.integers(0, 5), "echo": st.booleans(), "suffix": st.just("")}
COMPLETION_INVALID = INVALID | {
    "prompt": st.one_of(st.just(""), st.just([]), st.lists(st.integers(49152, 10**12), min_size=1, max_size=2),
                        st.lists(st.integers(-10, -1), min_size=1, max_size=2), JUNK),
    "logprobs": st.one_of(st.integers(21, 100), JUNK), "echo": JUNK, "best_of": st.integers(4, 20),
    "suffix": st.one_of(TEXT, JUNK)}
CONTENT = st.one_of(st.text(max_size=30), st.lists(st.fixed_dictionaries(
    {"type": st.just("text"), "text": st.text(max_size=10)}), min_size=1, max_size=2))
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"])},
                                optional={"content": CONTENT, "name": TEXT})
CHAT_VALID = VALID | {"logprobs": st.booleans(), "top_logprobs": st.integers(0, 5)}
CHAT_INVALID = INVALID | {
    "messages": st.one_of(st.just([]), st.lists(st.fixed_dictionaries({"role": st.one_of(
        st.sampled_from(["wizard", "USER"]), JUNK), "content": st.one_of(CONTENT, JUNK)}), min_size=1, max_size=2),
        st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(st.fixed_dictionaries(
            {"type": st.just("image_url"), "image_url": TEXT}), min_size=1, max_size=1)}), min_size=1, max_size=1),
        JUNK),
    "logprobs": JUNK, "top_logprobs": st.one_of(st.integers(21, 50), JUNK),
    "max_completion_tokens": st.one_of(st.integers(-3, 0), st.integers(600, 10**9), JUNK)}


@st.composite
def bodies(draw: st.DrawFn, required: dict, valid: dict, invalid: dict) -> dict:
    """A request with some valid optional fields, and 0 to 2 fields (required ones too) spoiled."""
    body = {k: draw(v) for k, v in required.items()}
    for k in draw(st.lists(st.sampled_from(sorted(valid)), unique=True, max_size=6)):
        body[k] = draw(valid[k])
    n_bad = draw(st.sampled_from([0, 0, 0, 1, 1, 2]))
    for k in draw(st.lists(st.sampled_from(sorted(invalid)), unique=True, min_size=n_bad, max_size=n_bad)):
        body[k] = draw(invalid[k])
    if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 4  # a chat request without any limit would generate up to max_model_len
    return body


COMPLETION_BODY = bodies({"model": st.just("__MODEL__"), "prompt": PROMPTS, "max_tokens": st.integers(1, 4)},
                         COMPLETION_VALID, COMPLETION_INVALID)
CHAT_BODY = bodies({"model": st.just("__MODEL__"), "messages": st.lists(MESSAGE, min_size=1, max_size=4),
                    "max_tokens": st.integers(1, 4)}, CHAT_VALID, CHAT_INVALID)
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
    elif path.startswith("/v1/"):
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


def test_fuzz_request_bodies_fake_engine():
    server = FakeServer(step_delay=0.0)
    server.http.start()
    try:
        _fuzz(server.url, server.headers, "fake-model", examples=300)
    finally:
        server.http.stop()


@pytest.mark.slow
def test_fuzz_request_bodies_real_server(real_server: ServerProcess):
    with real_server.client() as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
    _fuzz(real_server.url, real_server.headers, model, examples=60)
