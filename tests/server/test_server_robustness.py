"""No client can stall the server: tokenization off the event loop, a body-size limit answered before the body is
read, read timeouts for request heads and bodies, rate-limited error logs, streams cut cleanly at shutdown, and
one-line CLI errors. Every socket is on 127.0.0.1; every wait is bounded (a timeout turns a hang into a failure,
never a speed assertion)."""
from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket
import subprocess
import sys
import threading

import httpx
import pytest
from fake_llm_engine import FakeTokenizer
from server_helpers import API_KEY, FakeServer
from test_server_api_fake import assert_error

from rooflm.server.protection import RateLimitFilter, header_timeout_protocol

HANG_S = 60.0  # a wait this long is a hang


class BlockingTokenizer(FakeTokenizer):
    """Blocks encoding any text longer than a megabyte until the test releases it."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > 2**20:
            self.entered.set()
            assert self.release.wait(HANG_S)
        return super().encode(text, add_special_tokens)


def raw_request(port: int, data: bytes, timeout: float = HANG_S) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it or sent a whole small response."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while True:
            try:
                piece = s.recv(65536)
            except ConnectionResetError:
                break
            if not piece:
                break
            out += piece
            head, _, body = out.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), None)
            if length is not None and len(body) >= length:
                break
        return out


def test_health_and_other_requests_answer_while_a_20mb_prompt_is_tokenized():
    tok = BlockingTokenizer()
    server = FakeServer(tokenizer=tok)
    server.http.start()
    try:
        result: dict[str, httpx.Response] = {}

        def send_huge() -> None:
            with server.client(timeout=HANG_S) as c:
                result["huge"] = c.post("/v1/completions", json={"prompt": "a" * (20 * 2**20), "max_tokens": 1})

        t = threading.Thread(target=send_huge)
        t.start()
        assert tok.entered.wait(HANG_S), "the huge prompt never reached the tokenizer"
        # The tokenizer is stuck on the huge prompt: the event loop must still answer.
        assert httpx.get(server.url + "/health", timeout=HANG_S).status_code == 200
        with server.client(timeout=HANG_S) as c:
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["choices"][0]["text"]
        tok.release.set()
        t.join(HANG_S)
        assert_error(result["huge"], 400, "prompt")
    finally:
        tok.release.set()
        server.http.stop()


def test_announced_body_over_the_limit_is_413_before_it_is_read():
    server = FakeServer(app_kw={"max_body_mb": 1})
    server.http.start()
    try:
        port = int(server.url.rsplit(":", 1)[1])
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {64 * 2**20}\r\n\r\n").encode()
        answer = raw_request(port, head)  # not one byte of the 64 MB body is sent
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        err = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
        assert err["code"] == "request_too_large" and "--max-request-body-mb" in err["message"]
        with server.client() as c:  # a body just under the limit still works
            r = c.post("/v1/completions", json={"prompt": "x" * 100, "max_tokens": 1})
            assert r.status_code == 200
    finally:
        server.http.stop()


def test_chunked_body_over_the_limit_is_413():
    server = FakeServer(app_kw={"max_body_mb": 1})
    server.http.start()
    try:
        def body():
            yield b'{"prompt": "'
            for _ in range(64):
                yield b"x" * 2**16  # 4 MiB in all, no Content-Length
            yield b'"}'

        with server.client() as c:
            try:
                r = c.post("/v1/completions", content=body(), headers={"Content-Type": "application/json"})
                assert_error(r, 413)
            except httpx.TransportError:
                pass  # the server may close the connection before the client has sent everything
        assert httpx.get(server.url + "/health", timeout=HANG_S).status_code == 200
    finally:
        server.http.stop()


def test_stalled_body_is_408():
    server = FakeServer(app_kw={"body_timeout_s": 0.5})
    server.http.start()
    try:
        port = int(server.url.rsplit(":", 1)[1])
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
                "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"").encode()
        answer = raw_request(port, head)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    finally:
        server.http.stop()


def test_slow_header_sockets_are_closed_while_normal_requests_go_on():
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    count = max(50, min(2000, (soft - 256) // 2))  # each socket costs a descriptor on both ends here
    server = FakeServer(uvicorn_kw={"http": header_timeout_protocol(1.0)})
    server.http.start()
    port = int(server.url.rsplit(":", 1)[1])
    socks: list[socket.socket] = []
    try:
        for i in range(count):
            s = socket.create_connection(("127.0.0.1", port), timeout=HANG_S)
            if i % 2:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # the head never ends
            socks.append(s)
        with server.client(timeout=HANG_S) as c:
            assert c.get("/health").status_code == 200
            assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        for s in socks:  # each one is closed by the server: recv sees the end of the stream
            try:
                assert s.recv(1024) == b""
            except ConnectionResetError:
                pass
        assert httpx.get(server.url + "/health", timeout=HANG_S).status_code == 200
    finally:
        for s in socks:
            s.close()
        server.http.stop()


def test_rate_limit_filter_logs_each_kind_once_per_interval():
    now = [0.0]
    f = RateLimitFilter(10.0, clock=lambda: now[0])

    def rec(msg: str) -> logging.LogRecord:
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None, None)

    assert f.filter(rec("socket.accept() out of system resource"))
    assert not any(f.filter(rec("socket.accept() out of system resource")) for _ in range(1000))
    assert f.filter(rec("another message"))
    now[0] = 10.5
    r = rec("socket.accept() out of system resource")
    assert f.filter(r) and "1000 more like this" in r.getMessage()


def test_cut_streams_end_with_an_error_event_and_done():
    server = FakeServer()
    server.fake.hold()
    server.http.start()
    try:
        with server.client(timeout=HANG_S) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 50, "stream": True}) as r:
                assert server.fake.wait_until(lambda: len(server.fake.added) == 1)
                server.fake.allow(1)
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                assert json.loads(first[6:])["choices"][0]["text"]
                loop = server.http.server.servers[0].get_loop()  # uvicorn's loop, in the server thread
                asyncio.run_coroutine_threadsafe(_cut(server), loop).result(HANG_S)
                rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        event = json.loads(rest[-2][6:])
        assert event["error"]["code"] == "server_shutdown"
        assert server.fake.wait_until(lambda: server.fake.aborted == server.fake.added)
    finally:
        server.fake.release()
        server.http.stop()


async def _cut(server: FakeServer) -> None:
    server.app.state.serving.cut_streams()


@pytest.mark.parametrize("args", [["--port", "99999"], ["--port", "http"], ["--max-num-seqs", "many"],
                                  ["--max-request-body-mb", "0"], ["--shutdown-timeout", "-1"]])
def test_bad_cli_values_are_one_line_and_exit_2(args):
    proc = subprocess.run([sys.executable, "-m", "rooflm.cli", "serve", *args], capture_output=True, text=True,
                          timeout=HANG_S * 2)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and args[0] in lines[0] and "Traceback" not in proc.stderr, proc.stderr
