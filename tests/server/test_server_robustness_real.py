"""Robustness of `rooflm serve` with the embedded model in a subprocess: a 64 MB body is refused without the
server's memory growing by it, and a double Ctrl-C ends every stream with an error event and exits 1 at once."""
from __future__ import annotations

import json
import signal
import socket
import time

import httpx
import pytest
from server_helpers import API_KEY, ServerProcess

pytestmark = pytest.mark.slow
HANG_S = 120.0
MB = 2**20


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_64mb_body_is_413_without_memory_growth(real_server: ServerProcess):
    port = int(real_server.url.rsplit(":", 1)[1])
    before = rss_bytes(real_server.proc.pid)
    # Announced: refused from the head alone.
    with socket.create_connection(("127.0.0.1", port), timeout=HANG_S) as s:
        s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {64 * MB}\r\n\r\n").encode())
        assert s.recv(65536).startswith(b"HTTP/1.1 413")
    # Not announced (chunked): read up to the limit (32 MiB by default), then refused.

    def body():
        yield b'{"prompt": ['
        for _ in range(64):
            yield b"1," * (MB // 2)
        yield b"1]}"

    try:
        with httpx.Client(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=HANG_S) as c:
            r = c.post(real_server.url + "/v1/completions", content=body(),
                       headers={"Content-Type": "application/json"})
            assert r.status_code == 413
    except httpx.TransportError:
        pass  # the server closed the connection before the client sent everything
    grown = rss_bytes(real_server.proc.pid) - before
    assert grown < 64 * MB, f"the server grew by {grown / MB:.0f} MiB"
    assert httpx.get(real_server.url + "/health", timeout=HANG_S).status_code == 200


def test_double_sigint_ends_streams_with_an_error_event_and_exits_1(small_server: ServerProcess):
    body = {"prompt": "Count: one, two,", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with small_server.client() as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            small_server.proc.send_signal(signal.SIGINT)
            # Two signals sent back to back may arrive as one: wait until the server has taken the first.
            deadline = time.monotonic() + HANG_S
            while not any("SIGINT: no new connections" in line for line in small_server.lines):
                assert time.monotonic() < deadline, small_server.output()
                time.sleep(0.01)
            small_server.proc.send_signal(signal.SIGINT)
            rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]", rest[-3:]
    assert json.loads(rest[-2]).get("error", {}).get("code") == "server_shutdown", (len(rest), rest[-3:])
    assert small_server.proc.wait(HANG_S) == 1
    out = small_server.output()
    assert "Traceback" not in out and "terminate called" not in out, out
