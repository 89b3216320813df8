"""Acceptance against `rooflm serve` with the embedded default model (SmolLM2-135M-Instruct on the CPU):
the official openai client, greedy streaming == non-streaming, 64 concurrent streams with disconnects, and one test
per error case of the issue (400 naming the field, 404, 401, prompt over the limit, 503, SIGTERM)."""
from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import socket
import threading
import time
from typing import Iterator

import httpx
import openai
import pytest
from server_helpers import API_KEY, REAL_MAX_MODEL_LEN, SMALL_MAX_MODEL_LEN, ServerProcess

pytestmark = pytest.mark.slow


def client(server: ServerProcess, key: str | None = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key or "none", timeout=120, max_retries=0)


def model_id(server: ServerProcess) -> str:
    return client(server).models.list().data[0].id


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


# ------------------------------------------------------------------------------------------------------------ openai
def test_openai_client_lists_completes_and_chat_completes(real_server: ServerProcess):
    c = client(real_server)
    model = model_id(real_server)
    done = c.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert done.object == "text_completion" and done.model == model
    assert done.choices[0].finish_reason in ("length", "stop") and done.choices[0].text
    assert 0 < done.usage.completion_tokens <= 8 and done.usage.prompt_tokens > 0
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens

    chat = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                     max_tokens=8, temperature=0)
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert 0 < chat.usage.completion_tokens <= 8


def test_greedy_stream_equals_non_stream_completions(real_server: ServerProcess):
    c = client(real_server)
    model = model_id(real_server)
    kw = dict(model=model, prompt="Once upon a time, in a small village,", max_tokens=16, temperature=0)
    full = c.completions.create(**kw)
    text, finish, usage = "", None, None
    for chunk in c.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert text == full.choices[0].text and finish == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_greedy_stream_equals_non_stream_chat(real_server: ServerProcess):
    c = client(real_server)
    model = model_id(real_server)
    kw = dict(model=model, messages=[{"role": "system", "content": "You are terse."},
                                     {"role": "user", "content": "Name a colour."}], max_tokens=16, temperature=0)
    full = c.chat.completions.create(**kw)
    pieces, roles = [], []
    for chunk in c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            roles.append(ch.delta.role)
            pieces.append(ch.delta.content or "")
    assert roles[0] == "assistant"
    assert "".join(pieces) == full.choices[0].message.content


def test_seeded_sampling_is_reproducible_and_logprobs_are_reported(real_server: ServerProcess):
    c = client(real_server)
    model = model_id(real_server)
    kw = dict(model=model, prompt="My favourite animal is", max_tokens=6, temperature=0.9, top_p=0.95, seed=1234,
              logprobs=3, extra_body={"top_k": 40, "min_p": 0.01, "repetition_penalty": 1.1})
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    lp = a.choices[0].logprobs
    assert len(lp.tokens) == a.usage.completion_tokens and all(x <= 0 for x in lp.token_logprobs)
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)


# ------------------------------------------------------------------------------------------------------------ load
def test_64_concurrent_streams_a_third_disconnecting(real_server: ServerProcess):
    """64 streaming clients at once; a random third leave after their first chunk (while still generating: they
    asked for many tokens). Every other stream must complete correctly, and afterwards the engine must hold no
    running request and the whole KV pool must be free again."""
    rng = random.Random(4)
    leavers = set(rng.sample(range(64), 21))
    prompts = ["The sun", "A quiet river", "In the morning", "Four score"]  # short: no prefix-cache sharing
    with real_server.client() as c:
        before = c.get("/metrics").text
        # References for the completing streams (greedy, same length).
        refs = {p: c.post("/v1/completions", json={"prompt": p, "max_tokens": 8, "temperature": 0,
                                                   "ignore_eos": True}).json()["choices"][0]["text"] for p in prompts}

    async def one(i: int, http: httpx.AsyncClient) -> dict:
        leave = i in leavers
        body = {"prompt": prompts[i % 4], "temperature": 0, "ignore_eos": True, "stream": True,
                "max_tokens": 200 if leave else 8, "stream_options": {"include_usage": True}}
        text, finish, usage, done, chunks = "", None, None, False, 0
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                ev = json.loads(data)
                if ev["choices"]:
                    chunks += 1
                    text += ev["choices"][0]["text"]
                    finish = ev["choices"][0]["finish_reason"] or finish
                if ev.get("usage"):
                    usage = ev["usage"]
                if leave and chunks >= 1:
                    break  # disconnect mid-stream
        return {"i": i, "text": text, "finish": finish, "usage": usage, "done": done}

    async def run_all() -> list[dict]:
        limits = httpx.Limits(max_connections=80, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=real_server.url, headers=real_server.headers, limits=limits,
                                     timeout=httpx.Timeout(180, connect=30)) as http:
            return await asyncio.wait_for(asyncio.gather(*(one(i, http) for i in range(64))), 240)

    results = asyncio.run(run_all())
    for res in results:
        if res["i"] in leavers:
            continue
        assert res["done"] and res["finish"] == "length", res
        assert res["usage"]["completion_tokens"] == 8, res
        assert res["text"] == refs[prompts[res["i"] % 4]], res

    deadline = time.monotonic() + 30
    with real_server.client() as c:
        while True:
            m = c.get("/metrics").text
            idle = (metric(m, "rooflm_num_requests_running") == 0 and metric(m, "rooflm_num_requests_waiting") == 0
                    and metric(m, "rooflm_num_requests_unfinished") == 0
                    and metric(m, "rooflm_kv_cache_free_blocks") == metric(m, "rooflm_kv_cache_total_blocks") > 0)
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.25)
    assert idle, m
    assert metric(m, "rooflm_kv_cache_usage_ratio") == 0
    label = '{endpoint="completions",outcome="aborted"}'
    assert metric(m, "rooflm_requests_total", label) - metric(before, "rooflm_requests_total", label) == len(leavers)


# ------------------------------------------------------------------------------------------------------------ errors
def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_invalid_body_is_400_naming_the_field_not_422(real_server: ServerProcess):
    with real_server.client() as c:
        err = _error(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": "eight"}), 400)
        assert err["param"] == "max_tokens" and err["type"] == "invalid_request_error"
        err = _error(c.post("/v1/chat/completions", json={"messages": [], "max_tokens": 4}), 400)
        assert err["param"] == "messages"
        err = _error(c.post("/v1/completions", json={"prompt": "hi", "temperature": 7}), 400)
        assert err["param"] == "temperature"
        err = _error(c.post("/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"}),
                     400)
        assert "JSON" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client(real_server).completions.create(model=model_id(real_server), prompt="x", max_tokens=4, top_p=3)
    assert e.value.status_code == 400 and e.value.body["param"] == "top_p"


def test_unknown_model_is_404(real_server: ServerProcess):
    with pytest.raises(openai.NotFoundError) as e:
        client(real_server).completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert e.value.status_code == 404 and "no-such-model" in e.value.message


def test_missing_or_wrong_api_key_is_401(real_server: ServerProcess):
    for headers in ({}, {"Authorization": "Bearer not-the-key"}, {"Authorization": API_KEY}):
        r = httpx.post(real_server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=headers,
                       timeout=30)
        assert _error(r, 401)["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        client(real_server, key="wrong").models.list()
    assert httpx.get(real_server.url + "/health", timeout=30).status_code == 200  # health needs no key


def test_prompt_over_the_limit_is_400_stating_the_limit(real_server: ServerProcess):
    long_prompt = "word " * (REAL_MAX_MODEL_LEN + 50)
    with real_server.client() as c:
        err = _error(c.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 4}), 400)
        assert str(REAL_MAX_MODEL_LEN) in err["message"] and err["param"] == "prompt"
        assert err["code"] == "context_length_exceeded"
        err = _error(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": long_prompt}]}),
                     400)
        assert str(REAL_MAX_MODEL_LEN) in err["message"] and err["param"] == "messages"
        err = _error(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": REAL_MAX_MODEL_LEN}), 400)
        assert str(REAL_MAX_MODEL_LEN) in err["message"] and err["param"] == "max_tokens"


def test_tokenize_detokenize_round_trip(real_server: ServerProcess):
    with real_server.client() as c:
        tok = c.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
        assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == REAL_MAX_MODEL_LEN
        assert c.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "Hello world"


def _first_chunk(lines: Iterator[str]) -> str:
    """The first data line of ``lines``, which the caller keeps referenced while the stream should stay open: a line
    iterator that is dropped gets closed, and httpx then closes the connection (the server aborts the request)."""
    for line in lines:
        if line.startswith("data: "):
            return line
    raise AssertionError("no chunk")


def test_full_waiting_queue_is_503_at_once(small_server: ServerProcess):
    """One running sequence, no waiting room: a second request while the first runs gets 503 immediately."""
    with small_server.client() as c:
        # as many tokens as the context holds: the first request runs for hundreds of steps after its first chunk,
        # where the second request needs one round trip on the loopback to arrive
        body = {"prompt": "Count: one, two,", "max_tokens": SMALL_MAX_MODEL_LEN - 16, "ignore_eos": True,
                "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            _first_chunk(lines)
            # The first stream is still open and unfinished (only one chunk read): with no waiting room the
            # second request can only be refused, not queued behind it.
            r2 = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            err = _error(r2, 503)
            assert err["code"] == "queue_full"
        # the first one is aborted by leaving; then the server admits again
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            r3 = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            if r3.status_code == 200:
                break
            time.sleep(0.2)
        assert r3.status_code == 200, r3.text


def test_sigterm_finishes_in_flight_request_then_exits(small_server: ServerProcess):
    """SIGTERM: the listener closes while a stream is open, that in-flight stream still completes, and the process
    exits 0. The client reads no further than the first chunk until it has seen a new connection refused, so the
    order does not depend on how fast the machine generates."""
    assert small_server.url is not None
    port = int(small_server.url.rsplit(":", 1)[1])
    result: dict = {}
    first_chunk, refused = threading.Event(), threading.Event()

    def stream() -> None:
        with small_server.client() as c:
            body = {"prompt": "Count: one, two,", "max_tokens": 48, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        if len(lines) == 1:
                            first_chunk.set()
                            refused.wait(120)  # only a hang guard: the main thread sets it
                result["lines"] = lines

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    assert first_chunk.wait(120), small_server.output()
    small_server.proc.send_signal(signal.SIGTERM)

    deadline = time.monotonic() + 60  # new connections are refused while the stream is still open
    while not refused.is_set():
        assert time.monotonic() < deadline, "the listener never closed after SIGTERM"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            time.sleep(0.05)
        except OSError:
            refused.set()
    assert t.is_alive()  # the stream was still open when the connection was refused

    t.join(120)
    assert not t.is_alive()
    lines = result["lines"]
    assert lines[-1] == "[DONE]"
    usage = json.loads(lines[-2])["usage"]
    assert usage["completion_tokens"] == 48
    finishes = [json.loads(x)["choices"][0]["finish_reason"] for x in lines[:-2]]
    assert finishes[-1] == "length"
    assert small_server.proc.wait(60) == 0, small_server.output()
