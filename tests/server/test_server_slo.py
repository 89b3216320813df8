"""A request refused by SLO-aware admission is answered 503 at once, with a Retry-After header and its own error
code, and never reaches the engine's queue."""
from __future__ import annotations

import time
from types import SimpleNamespace

from rooflm.engine.admission import RecentQuantile, SLORejectedError

from server_helpers import FakeServer


def assert_error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_slo_rejection_is_503(monkeypatch):
    server = FakeServer(step_delay=0)
    original = server.fake.add_request

    def add_request(request_id, prompt, params, arrival_time=None):
        if server.fake.tokenizer.decode(list(prompt)).startswith("slow"):  # the server hands over token ids
            raise SLORejectedError(request_id, 0.5, 0.1)
        return original(request_id, prompt, params, arrival_time)

    monkeypatch.setattr(server.fake, "add_request", add_request)
    server.http.start()
    try:
        with server.client() as c:
            r = c.post("/v1/completions", json={"prompt": "slow one", "max_tokens": 2})
            err = assert_error(r, 503)
            assert err["code"] == "ttft_slo_unattainable" and r.headers.get("retry-after")
            assert "predicted time to first token is at least 500 ms" in err["message"]
            ok = c.post("/v1/completions", json={"prompt": "fast one", "max_tokens": 2})
            assert ok.status_code == 200
        assert len(server.fake.added) == 1
    finally:
        server.http.stop()


def test_server_passes_its_arrival_stamp_and_reports_first_token_delivery(monkeypatch):
    """The engine's admission counts from the server's receipt (the handler's stamp) and learns how long the first
    token takes from the engine's stamp to the client; a non-streamed answer reports no delivery."""
    server = FakeServer(step_delay=0)
    server.fake.admission = SimpleNamespace(delivery=RecentQuantile(0.9, 8))
    original = server.fake.add_request
    seen = []

    def add_request(request_id, prompt, params, arrival_time=None):
        seen.append((arrival_time, time.monotonic()))
        return original(request_id, prompt, params, arrival_time)

    monkeypatch.setattr(server.fake, "add_request", add_request)
    server.http.start()
    try:
        with server.client() as c:
            before = time.monotonic()
            r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "stream": True})
            after = time.monotonic()
            assert r.status_code == 200 and "data: [DONE]" in r.text
            assert c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3}).status_code == 200
        arrival, added = seen[0]
        assert before <= arrival <= added <= after  # stamped by the handler, before the engine took it
        assert len(server.fake.admission.delivery) == 1  # the streamed request only
        assert 0 <= server.fake.admission.delivery.value() <= after - before
    finally:
        server.http.stop()
