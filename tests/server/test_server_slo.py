"""A request refused by SLO-aware admission is answered 503 at once, with a Retry-After header and its own error
code, and never reaches the engine's queue."""
from __future__ import annotations

from rooflm.engine.admission import SLORejectedError

from server_helpers import FakeServer


def assert_error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_slo_rejection_is_503(monkeypatch):
    server = FakeServer(step_delay=0)
    original = server.fake.add_request

    def add_request(request_id, prompt, params):
        if server.fake.tokenizer.decode(list(prompt)).startswith("slow"):  # the server hands over token ids
            raise SLORejectedError(request_id, 0.5, 0.1)
        return original(request_id, prompt, params)

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
