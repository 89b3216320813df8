"""The HTTP API over the fast fake engine: response shapes, streaming, options, every error shape."""
from __future__ import annotations

import json
import time

import httpx
import pytest
from server_helpers import API_KEY, FakeServer

from rooflm.server.app import build_app  # noqa: F401  (import check: the server package imports cleanly)


def sse_events(response: httpx.Response) -> list[dict | str]:
    events: list[dict | str] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


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


def test_completion_logprobs(shared_fake_server: FakeServer):
    with shared_fake_server.client() as c:
        body = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "logprobs": 2}).json()
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 3
    assert all(len(t) <= 2 for t in lp["top_logprobs"]) and lp["text_offset"] == [0, 1, 2]


def test_chat_completion_with_logprobs(shared_fake_server: FakeServer):
    with shared_fake_server.client() as c:
        body = c.post("/v1/chat/completions", json={
            "messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 2}).json()
    (choice,) = body["choices"]
    assert body["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    content = choice["logprobs"]["content"]
    assert len(content) == 4 and all(len(c["top_logprobs"]) == 2 and "bytes" in c for c in content)
    assert body["usage"]["completion_tokens"] == 4


def test_stop_string_ends_the_completion(shared_fake_server: FakeServer):
    with shared_fake_server.client() as c:
        body = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 20, "temperature": 0,
                                               "stop": ["ij"]}).json()
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


def test_client_disconnect_mid_stream_aborts_and_frees_blocks():
    server = FakeServer(step_delay=0.01)
    server.http.start()
    try:
        with server.client() as c:
            with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 100, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        break  # leave after the first chunk
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (server.fake.has_unfinished_requests()
                                               or server.engine.num_unfinished_requests):
            time.sleep(0.02)
        assert len(server.fake.aborted) == 1
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and server.engine.stats.num_free_blocks != server.engine.stats.num_total_blocks:
            time.sleep(0.02)
        assert server.engine.stats.num_running == 0
        assert server.engine.stats.num_free_blocks == server.engine.stats.num_total_blocks
        metrics = httpx.get(server.url + "/metrics").text
        assert 'rooflm_requests_total{endpoint="completions",outcome="aborted"} 1.0' in metrics
    finally:
        server.http.stop()


def test_disconnect_from_a_multi_prompt_stream_aborts_every_prompt():
    server = FakeServer(step_delay=0.01)
    server.http.start()
    try:
        with server.client() as c:
            body = {"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 100, "stream": True}
            with c.stream("POST", "/v1/completions", json=body) as r:
                next(line for line in r.iter_lines() if line.startswith("data: "))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (server.fake.has_unfinished_requests()
                                               or server.engine.num_unfinished_requests):
            time.sleep(0.02)
        assert sorted(set(server.fake.aborted)) == sorted(f"{rid.rsplit('-', 1)[0]}-{i}" for i, rid in
                                                          zip(range(3), [server.fake.aborted[0]] * 3))
        assert server.engine._unfinished_seqs == 0
    finally:
        server.http.stop()


def test_client_disconnect_during_non_streamed_request_aborts():
    server = FakeServer(step_delay=0.02)
    server.http.start()
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=0.5,
                       json={"prompt": "x", "max_tokens": 120})  # ~2.4 s of generation
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not server.fake.aborted:
            time.sleep(0.05)
        assert len(server.fake.aborted) == 1
    finally:
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
        assert_error(c.post("/v1/completions", json={"prompt": "x", "logit_bias": {"1": 2}}), 400, "logit_bias")
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
    server = FakeServer(max_waiting=0, step_delay=0.01, config=None)
    server.fake.config.max_num_seqs = 1
    server.engine.max_num_seqs = 1
    server.http.start()
    try:
        with server.client() as c:
            with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 100, "stream": True}) as r:
                next(line for line in r.iter_lines() if line.startswith("data: "))
                t0 = time.monotonic()
                r2 = c.post("/v1/completions", json={"prompt": "y", "max_tokens": 2})
                assert time.monotonic() - t0 < 1.0
                err = assert_error(r2, 503)
                assert err["code"] == "queue_full" and r2.headers.get("retry-after")
        metrics = httpx.get(server.url + "/metrics").text
        assert 'rooflm_requests_total{endpoint="completions",outcome="rejected"} 1.0' in metrics
    finally:
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


def test_metrics_count_outcomes_and_latencies(shared_fake_server: FakeServer):
    with shared_fake_server.client() as c:
        c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        c.post("/v1/completions", json={"prompt": "x", "max_tokens": "3"})
        text = c.get("/metrics").text
    for name in ("rooflm_time_to_first_token_seconds_bucket", "rooflm_time_per_output_token_seconds_count",
                 "rooflm_e2e_request_latency_seconds_sum", "rooflm_kv_cache_usage_ratio",
                 "rooflm_prefix_cache_hit_rate", "rooflm_prompt_tokens_total", "rooflm_generation_tokens_total",
                 "rooflm_num_requests_waiting", 'outcome="success"', 'outcome="invalid"'):
        assert name in text, name
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
