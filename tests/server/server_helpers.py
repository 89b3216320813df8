"""Servers for the server tests (imported by conftest.py and the tests; a unique module name, unlike conftest).

- ``FakeServer``: the real app + AsyncLLMEngine in-process (uvicorn in a thread) over a fast fake engine.
- ``ServerProcess``: ``rooflm serve`` in a subprocess (the real engine and default model).

Every wait has a timeout.
"""
from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import httpx

from fake_llm_engine import FakeConfig, FakeEngine

API_KEY = "test-key-4"
REAL_MAX_MODEL_LEN = 512
SMALL_MAX_MODEL_LEN = 256
READY_TIMEOUT_S = float(os.environ.get("ROOFLM_TEST_SERVER_TIMEOUT", "300"))

HAVE_REAL_ENGINE = importlib.util.find_spec("rooflm.engine.engine") is not None
# `rooflm serve`, the command users run (python -m rooflm.cli is the `rooflm` console script).
SERVE_CMD = [sys.executable, "-m", "rooflm.cli", "serve"]


# ---------------------------------------------------------------------------------------------------------------------
# In-process server (fake engine)
# ---------------------------------------------------------------------------------------------------------------------
class InProcessServer:
    def __init__(self, app: Any, **uvicorn_kw: Any) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # see launcher.bind_socket
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                                    timeout_graceful_shutdown=5, **uvicorn_kw))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> "InProcessServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("in-process server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


class FakeServer:
    def __init__(self, api_key: str | None = API_KEY, max_waiting: int | None = 64, step_delay: float = 0.002,
                 config: FakeConfig | None = None, tokenizer: Any = None, app_kw: dict[str, Any] | None = None,
                 uvicorn_kw: dict[str, Any] | None = None) -> None:
        from rooflm.engine.async_engine import AsyncLLMEngine
        from rooflm.server.app import build_app

        self.fake = FakeEngine(config or FakeConfig(max_model_len=128, max_num_seqs=8), step_delay=step_delay)
        if tokenizer is not None:
            self.fake.tokenizer = tokenizer
        self.engine = AsyncLLMEngine(self.fake, max_waiting=max_waiting)
        self.app = build_app(self.engine, api_key=api_key, **(app_kw or {}))
        self.http = InProcessServer(self.app, **(uvicorn_kw or {}))
        self.url = self.http.url
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def client(self, **kw: Any) -> httpx.Client:
        kw.setdefault("timeout", 30)
        return httpx.Client(base_url=self.url, headers=self.headers, **kw)


# ---------------------------------------------------------------------------------------------------------------------
# Subprocess server (real engine)
# ---------------------------------------------------------------------------------------------------------------------
class ServerProcess:
    """``python -m rooflm.cli serve --port 0 ...``; the URL is read from the line the command prints."""

    _URL = re.compile(r"^rooflm serve: .* on (http://\S+)\s*$")

    def __init__(self, *args: str, api_key: str | None = None) -> None:
        cmd = [*SERVE_CMD, "--host", "127.0.0.1", "--port", "0",
               "--log-level", "warning", "--show-progress", "false", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("ROOFLM_API_KEY", None)
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     env=env, start_new_session=True)
        self.lines: list[str] = []
        self.url: str | None = None
        self._url_seen = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._ready = False

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            m = self._URL.match(line)
            if m and self.url is None:
                self.url = m.group(1)
                self._url_seen.set()
        self._url_seen.set()  # EOF: the process ended

    def output(self) -> str:
        return "".join(self.lines[-60:])

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> "ServerProcess":
        if self._ready:
            return self
        deadline = time.monotonic() + timeout
        if not self._url_seen.wait(timeout) or self.url is None:
            self.stop()
            raise RuntimeError(f"rooflm serve did not start (exit {self.proc.poll()}):\n{self.output()}")
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rooflm serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    self._ready = True
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"rooflm serve was not healthy within {timeout} s:\n{self.output()}")

    def client(self, **kw: Any) -> httpx.Client:
        assert self.url is not None
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=120, **kw)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 30) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(5)
        return self.proc.returncode


# The weights dequantized to float32: the evaluation-API tests compare log-probabilities with transformers at 1e-3,
# which the default (GGUF blocks kept quantized, bfloat16 activations in the CPU kernels) is not meant to match.
REAL_ARGS = ("--max-model-len", str(REAL_MAX_MODEL_LEN), "--max-num-seqs", "64", "--max-waiting", "256",
             "--quantization", "none")
SMALL_ARGS = ("--max-model-len", str(SMALL_MAX_MODEL_LEN), "--max-num-seqs", "1", "--max-waiting", "0",
               "--kv-cache-memory", "64M", "--shutdown-timeout", "60")
