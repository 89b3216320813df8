"""The HTTP API over the fast fake engine: response shapes, streaming, options, every error shape.

These tests check the server's plumbing (what it hands to the engine, how it renders what the engine returns, when
it aborts). The engine behaviours themselves (stop strings, logprob values, KV blocks freed after a finish, an abort
or a disconnect) are tested on the real engine in tests/engine/test_engine_behaviour.py.
Tests that depend on the order of events hold the fake engine (see fake_llm_engine.py) instead of sleeping."""
from __future__ import annotations

import json
import re
import time
from typing import Callable

import httpx
import pytest
from fake_llm_engine import HANG_TIMEOUT_S, fake_logprobs
from server_helpers import API_KEY, FakeServer

from rooflm.server.app import build_app  # noqa: F401  (import check: the server package imports cleanly)


def sse_events(response: httpx.Response) -> list[dict | str]:
    events: list[dict | str] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def eventually(predicate: Callable[[], bool], what: str, timeout: float = HANG_TIMEOUT_S) -> None:
    """Poll until ``predicate()`` holds; the timeout only turns a hang into a failure."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


def metric(text: str, sample: str) -> float:
    """The value of one sample line of the Prometheus text, e.g. ``metric(text, 'rooflm_engine_steps_total')``."""
    m = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.MULTILINE)
    assert m is not None, f"{sample} not in /metrics"
    return float(m.group(1))


def top(d: dict[int, float], k: int) -> list[tuple[str, float]]:
    """The k most likely (text, logprob) of one position of the fake engine (token id = byte + 3)."""
    return [(chr(t - 3), v) for t, v in sorted(d.items(), key=lambda kv: -kv[1])[:k]]


def assert_error(r: httpx.Response, status: int, param: str | None = "ANY") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param != "ANY":
        assert err["param"] == param, err
    return err


# ------------------------------------------------------------------------------------------------------------ basics
def test_health_models_metrics_are_open_and_v1_needs_the_key(shared_fake_server: FakeServer):
    url = shared_fake_server.url
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert "rooflm_num_requests_running" in httpx.get(url + "/metrics").text
    assert_error(httpx.get(url + "/v1/models"), 401)
    assert_error(httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(httpx.post(url + "/v1/completions", json={"prompt": "x"}), 401)
    with shared_fake_server.client() as c:
        models = c.get("/v1/models").json()
        assert models["data"][0]["id"] == "fake-model"
        assert c.get("/v1/models/fake-model").json()["id"] == "fake-model"
        assert_error(c.get("/v1/models/other"), 404, "model")


def test_completion_shape_and_usage(shared_fake_server: FakeServer):
    with shared_fake_server.client() as c:
        r = c.post("/v1/completions", json={"model": "fake-model", "prompt": "hello", "max_tokens": 5,
                                            "temperature": 0})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion" and body["model"] == "fake-model"
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and len(choice["text"]) == 5
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}


def test_multiple_prompts_and_n_give_indexed_choices(shared_fake_server: FakeServer):
    with shared_fake_server.client() as c:
        body = c.post("/v1/completions", json={"prompt": ["ab", "cde"], "n": 2, "max_tokens": 3,
                                               "temperature": 1.0, "seed": 1}).json()
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 12


def test_token_id_prompts_and_echo(shared_fake_server: FakeServer):
    ids = [ord(ch) + 3 for ch in "hey"]
    with shared_fake_server.client() as c:
        body = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "echo": True}).json()
        assert body["choices"][0]["text"].startswith("hey")
        body = c.post("/v1/completions", json={"prompt": [ids, ids], "max_tokens": 2}).json()
        assert len(body["choices"]) == 2
        assert_error(c.post("/v1/completions", json={"prompt": [10**6], "max_tokens": 2}), 400, "prompt")


def test_completion_logprobs_render_the_engines_values(shared_fake_server: FakeServer):
    """The server asks the engine for ``logprobs`` and renders each position's values in the OpenAI shape."""
    with shared_fake_server.client() as c:
        body = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "logprobs": 2,
                                               "temperature": 1.0, "seed": 5}).json()
    assert shared_fake_server.fake.params[shared_fake_server.fake.added[-1]].logprobs == 2
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"] and lp["text_offset"] == [0, 1, 2]
    engine_lps = [fake_logprobs(ord(ch) + 3, 2) for ch in choice["text"]]  # what the engine returned
    assert lp["token_logprobs"] == [d[ord(ch) + 3] for ch, d in zip(choice["text"], engine_lps)]
    assert [list(t.items()) for t in lp["top_logprobs"]] == [top(d, 2) for d in engine_lps]


def test_chat_logprobs_render_the_engines_values(shared_fake_server: FakeServer):
    with shared_fake_server.client() as c:
        body = c.post("/v1/chat/completions", json={
            "messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 2}).json()
    (choice,) = body["choices"]
    assert body["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    content = choice["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == choice["message"]["content"]
    for c in content:
        d = fake_logprobs(ord(c["token"]) + 3, 2)  # what the engine returned for this position
        assert c["logprob"] == d[ord(c["token"]) + 3] and c["bytes"] == list(c["token"].encode())
        assert [(t["token"], t["logprob"]) for t in c["top_logprobs"]] == top(d, 2)
    assert body["usage"]["completion_tokens"] == 4


def test_stop_strings_reach_the_engine_and_its_stop_reason_the_response(shared_fake_server: FakeServer):
    with shared_fake_server.client() as c:
        body = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 20, "temperature": 0,
                                               "stop": ["ij"]}).json()
    params = shared_fake_server.fake.params[shared_fake_server.fake.added[-1]]
    assert params.stop == ["ij"] and params.max_tokens == 20
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and "ij" not in choice["text"] and choice["stop_reason"] == "ij"


# ------------------------------------------------------------------------------------------------------------ stream
@pytest.mark.parametrize("chat", [False, True])
def test_stream_concatenation_equals_the_non_streamed_answer(shared_fake_server: FakeServer, chat: bool):
    if chat:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]}
    else:
        path, body = "/v1/completions", {"prompt": "hello"}
    body |= {"max_tokens": 12, "temperature": 0, "n": 2}
    with shared_fake_server.client() as c:
        full = c.post(path, json=body).json()
        with c.stream("POST", path, json=body | {"stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == full["usage"]
    texts = {0: "", 1: ""}
    finish = {}
    for ev in events[:-2]:
        assert ev["usage"] is None
        (choice,) = ev["choices"]
        piece = (choice["delta"].get("content") or "") if chat else choice["text"]
        texts[choice["index"]] += piece
        if choice["finish_reason"]:
            finish[choice["index"]] = choice["finish_reason"]
    expected = {ch["index"]: (ch["message"]["content"] if chat else ch["text"]) for ch in full["choices"]}
    assert texts == expected and finish == {0: "length", 1: "length"}
    if chat:  # the role comes first
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_stream_without_include_usage_has_no_usage_key(shared_fake_server: FakeServer):
    with shared_fake_server.client() as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True}) as r:
            events = sse_events(r)
    assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])


def test_client_disconnect_mid_stream_aborts_the_engine_request():
    server = FakeServer(step_delay=0)
    server.fake.hold()
    server.fake.allow(1)  # the first chunk; then no progress, so the request cannot finish by itself
    server.http.start()
    try:
        with server.client() as c:
            with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 100, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        break  # leave after the first chunk
        assert server.fake.wait_until(lambda: bool(server.fake.aborted))
        assert server.fake.aborted == server.fake.added and server.fake.finished == []
        assert server.fake.tokens_of(server.fake.added[0]) == 1
        eventually(lambda: server.engine.num_unfinished_requests == 0, "the server dropped the request")
        eventually(lambda: 'outcome="aborted"} 1.0' in httpx.get(server.url + "/metrics").text, "aborted counted")
    finally:
        server.fake.release()
        server.http.stop()


def test_disconnect_from_a_multi_prompt_stream_aborts_every_prompt():
    server = FakeServer(step_delay=0)
    server.fake.hold()
    server.fake.allow(1)
    server.http.start()
    try:
        with server.client() as c:
            body = {"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 100, "stream": True}
            with c.stream("POST", "/v1/completions", json=body) as r:
                next(line for line in r.iter_lines() if line.startswith("data: "))
        fake = server.fake
        assert fake.wait_until(lambda: len(fake.aborted) == 3)
        assert len(fake.added) == 3 and sorted(fake.aborted) == sorted(fake.added) and fake.finished == []
        eventually(lambda: server.engine.num_unfinished_requests == 0, "the server dropped the requests")
        assert server.engine._unfinished_seqs == 0
    finally:
        server.fake.release()
        server.http.stop()


def test_client_disconnect_during_non_streamed_request_aborts():
    server = FakeServer(step_delay=0)
    server.fake.hold()  # nothing is generated: the request cannot finish before the client gives up
    server.http.start()
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=0.5,
                       json={"prompt": "x", "max_tokens": 120})
        assert server.fake.wait_until(lambda: bool(server.fake.aborted))
        assert server.fake.aborted == server.fake.added and server.fake.finished == []
    finally:
        server.fake.release()
        server.http.stop()


# ------------------------------------------------------------------------------------------------------------ errors
def test_malformed_json_is_400(shared_fake_server: FakeServer):
    with shared_fake_server.client() as c:
        for raw in (b"{", b'{"prompt": "x",}', b"\xff\xfe", b"", b"[1, 2]", b'"text"', b"null"):
            r = c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
            assert_error(r, 400)
        r = c.post("/v1/completions", content=b"prompt=x", headers={"content-type": "text/plain"})
        assert_error(r, 400)


@pytest.mark.parametrize("field,value", [
    ("max_tokens", "8"), ("max_tokens", 2.5), ("temperature", "hot"), ("n", True), ("stop", 3),
    ("prompt", {"text": "x"}), ("stream", "yes"), ("seed", "1"), ("logprobs", [1]), ("top_k", 1.5),
])
def test_wrong_types_are_400_naming_the_field(shared_fake_server: FakeServer, field: str, value: object):
    body = {"prompt": "hello", "max_tokens": 2} | {field: value}
    with shared_fake_server.client() as c:
        err = assert_error(c.post("/v1/completions", json=body), 400, field)
    assert field in err["message"]


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("temperature", -0.1), ("temperature", 2.5), ("top_p", 0), ("top_p", 1.5), ("n", 0),
    ("n", 1000), ("presence_penalty", 3), ("frequency_penalty", -2.5), ("logprobs", 21), ("min_p", 1.5),
    ("top_k", -2), ("repetition_penalty", 0), ("seed", 2**70), ("stop", [""]), ("stop", ["a"] * 17),
    ("min_tokens", -1), ("prompt", ""), ("prompt", []), ("prompt", [-1]),
])
def test_out_of_range_values_are_400_naming_the_field(shared_fake_server: FakeServer, field: str, value: object):
    body = {"prompt": "hello", "max_tokens": 2} | {field: value}
    with shared_fake_server.client() as c:
        assert_error(c.post("/v1/completions", json=body), 400, field)


def test_nan_and_infinity_are_400(shared_fake_server: FakeServer):
    with shared_fake_server.client() as c:
        for raw in (b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "top_p": Infinity}'):
            assert_error(c.post("/v1/completions", content=raw, headers={"content-type": "application/json"}), 400)


def test_empty_or_invalid_messages_are_400(shared_fake_server: FakeServer):
    with shared_fake_server.client() as c:
        assert_error(c.post("/v1/chat/completions", json={"messages": []}), 400, "messages")
        assert_error(c.post("/v1/chat/completions", json={}), 400, "messages")
        assert_error(c.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]}),
                     400, "messages")
        assert_error(c.post("/v1/chat/completions", json={"messages": [{"content": "x"}]}), 400, "messages")
        assert_error(c.post("/v1/chat/completions", json={"messages": "hi"}), 400, "messages")
        assert_error(c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}), 400, "messages")


def test_unsupported_and_inconsistent_options_are_400(shared_fake_server: FakeServer):
    with shared_fake_server.client() as c:
        assert_error(c.post("/v1/completions", json={"prompt": "x", "logit_bias": {"one": 2}}), 400, "logit_bias")
        assert_error(c.post("/v1/completions", json={"prompt": "x", "logit_bias": {"999999": 2}}), 400, "logit_bias")
        assert_error(c.post("/v1/completions", json={"prompt": "x", "logit_bias": {"5": 101}}), 400, "logit_bias")
        assert_error(c.post("/v1/completions", json={"prompt": "x", "stream_options": {"include_usage": True}}),
                     400, "stream_options")
        assert_error(c.post("/v1/completions", json={"prompt": "x", "best_of": 3}), 400, "best_of")
        assert_error(c.post("/v1/completions", json={"prompt": "x", "min_tokens": 5, "max_tokens": 2}),
                     400, "min_tokens")
        assert_error(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                          "top_logprobs": 2}), 400, "top_logprobs")


def test_unknown_model_is_404(shared_fake_server: FakeServer):
    with shared_fake_server.client() as c:
        err = assert_error(c.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404, "model")
        assert "gpt-9" in err["message"] and err["code"] == "model_not_found"
        assert_error(c.post("/v1/chat/completions", json={"model": "gpt-9", "messages": [
            {"role": "user", "content": "x"}]}), 404, "model")


def test_unknown_route_and_method_use_the_error_shape(shared_fake_server: FakeServer):
    with shared_fake_server.client() as c:
        assert_error(c.get("/v1/nothing"), 404)
        assert_error(c.get("/v1/completions"), 405)


def test_prompt_over_the_limit_is_400_stating_the_limit(shared_fake_server: FakeServer):
    with shared_fake_server.client() as c:
        err = assert_error(c.post("/v1/completions", json={"prompt": "x" * 300}), 400, "prompt")
        assert "128" in err["message"] and "300" in err["message"] and err["code"] == "context_length_exceeded"
        err = assert_error(c.post("/v1/completions", json={"prompt": "x" * 100, "max_tokens": 50}), 400, "max_tokens")
        assert "128" in err["message"]
        err = assert_error(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "y" * 200}]}),
                           400, "messages")
        assert "128" in err["message"]


def test_full_waiting_queue_is_503_at_once():
    """One running slot, no waiting room: while the first request holds the slot (the engine is held, so it cannot
    finish), a second one is answered 503 without waiting for capacity and never reaches the engine."""
    server = FakeServer(max_waiting=0, step_delay=0, config=None)
    server.fake.config.max_num_seqs = 1
    server.engine.max_num_seqs = 1
    server.fake.hold()  # no step generates before the request is in (an idle step would use up the permit)
    server.http.start()
    try:
        with server.client() as c:
            with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 100, "stream": True}) as r:
                assert server.fake.wait_until(lambda: len(server.fake.added) == 1)
                server.fake.allow(1)
                # The line iterator stays referenced while the stream is open: a dropped one is closed, and httpx
                # then closes the connection, which the server takes for a client gone and aborts the request. The
                # second request would then race that abort for the slot.
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                r2 = c.post("/v1/completions", json={"prompt": "y", "max_tokens": 2})
                err = assert_error(r2, 503)
                assert err["code"] == "queue_full" and r2.headers.get("retry-after")
                assert len(server.fake.added) == 1 and server.fake.finished == []
        metrics = httpx.get(server.url + "/metrics").text
        assert metric(metrics, 'rooflm_requests_total{endpoint="completions",outcome="rejected"}') == 1
    finally:
        server.fake.release()
        server.http.stop()


def test_tokenize_and_detokenize(shared_fake_server: FakeServer):
    with shared_fake_server.client() as c:
        tok = c.post("/tokenize", json={"prompt": "hey"}).json()
        assert tok["tokens"] == [ord(ch) + 3 for ch in "hey"] and tok["count"] == 3 and tok["max_model_len"] == 128
        assert c.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": "hey"}
        chat = c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert chat["count"] > 2
        assert_error(c.post("/tokenize", json={}), 400)
        assert_error(c.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens")
        assert_error(c.post("/detokenize", json={"tokens": "abc"}), 400, "tokens")


def test_no_key_configured_means_open_api():
    server = FakeServer(api_key=None)
    server.http.start()
    try:
        assert httpx.get(server.url + "/v1/models").status_code == 200
    finally:
        server.http.stop()


def test_metrics_count_known_traffic_exactly():
    """After known traffic, every counter holds the exact count: requests by outcome, finished sequences by reason,
    one latency sample per successful request, and the engine's prompt / generation tokens."""
    server = FakeServer(step_delay=0)
    server.http.start()
    try:
        prompts = ["ab", "cde", "fghi"]
        with server.client() as c:
            for i, p in enumerate(prompts):  # 3 successes: 2 + 3 + 4 prompt tokens, 4 + 5 + 6 generated
                assert c.post("/v1/completions", json={"prompt": p, "max_tokens": 4 + i, "temperature": 0}
                              ).status_code == 200
            assert c.post("/v1/chat/completions", json={  # one more success, ended by a stop string
                "messages": [{"role": "user", "content": "q"}], "max_tokens": 20, "temperature": 0,
                "stop": ["f"]}).json()["choices"][0]["finish_reason"] == "stop"
            for _ in range(2):  # 2 invalid
                assert_error(c.post("/v1/completions", json={"prompt": "x", "max_tokens": "3"}), 400)
            assert_error(c.post("/v1/completions", json={"prompt": "x", "model": "gpt-9"}), 404)
        assert_error(httpx.post(server.url + "/v1/completions", json={"prompt": "x"}), 401)
        fake = server.fake
        chat_prompt = len(fake.tokenizer.apply_chat_template([{"role": "user", "content": "q"}]).encode())
        chat_generated = fake.tokens_of(fake.added[3])
        # The engine thread snapshots the stats after each step: wait for the one taken after the last step.
        eventually(lambda: server.engine.stats.num_steps == fake.num_steps, "stats snapshot after the last step")
        text = httpx.get(server.url + "/metrics").text
    finally:
        server.http.stop()
    requests = 'rooflm_requests_total{endpoint="%s",outcome="%s"}'
    assert metric(text, requests % ("completions", "success")) == 3
    assert metric(text, requests % ("chat_completions", "success")) == 1
    assert metric(text, requests % ("completions", "invalid")) == 2
    assert metric(text, requests % ("completions", "not_found")) == 1
    assert metric(text, requests % ("completions", "unauthorized")) == 1
    assert metric(text, 'rooflm_request_finish_total{finish_reason="length"}') == 3
    assert metric(text, 'rooflm_request_finish_total{finish_reason="stop"}') == 1
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds"):
        assert metric(text, f"rooflm_{hist}_count") == 4
    assert metric(text, "rooflm_prompt_tokens_total") == 2 + 3 + 4 + chat_prompt
    assert metric(text, "rooflm_generation_tokens_total") == 4 + 5 + 6 + chat_generated
    assert metric(text, "rooflm_engine_steps_total") == fake.num_steps
    assert metric(text, "rooflm_kv_cache_free_blocks") == metric(text, "rooflm_kv_cache_total_blocks") == 256
    assert metric(text, "rooflm_num_requests_running") == 0 and metric(text, "rooflm_kv_cache_usage_ratio") == 0
    assert API_KEY not in text


def test_lone_surrogates_are_400_naming_the_field(shared_fake_server: FakeServer):
    with shared_fake_server.client() as c:
        for field, raw in (("prompt", b'{"prompt": "a\\ud800", "max_tokens": 1}'),
                           ("model", b'{"prompt": "a", "model": "\\udfff"}'),
                           ("stop", b'{"prompt": "a", "stop": ["\\ud800"]}')):
            r = c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
            assert_error(r, 400, field)
        r = c.post("/v1/chat/completions", headers={"content-type": "application/json"},
                   content=b'{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 1}')
        assert_error(r, 400, "messages")


def test_listening_socket_is_tcp_so_asyncio_disables_nagle():
    """asyncio sets TCP_NODELAY only on accepted sockets whose proto is IPPROTO_TCP; with Nagle on, each small
    SSE chunk and each keep-alive response waits ~40 ms for the client's delayed ACK."""
    import socket

    from rooflm.server.launcher import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()
