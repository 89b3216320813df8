"""Run the app with uvicorn: load the model first, then listen; on SIGTERM/SIGINT stop accepting connections, let
in-flight requests finish for up to ``--shutdown-timeout`` seconds, stop the engine and exit 0."""
from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket
import sys
import threading
from typing import Any, Iterator

import uvicorn

from rooflm.entrypoints.args import engine_config_from_args
from rooflm.engine.async_engine import AsyncLLMEngine
from rooflm.server.app import build_app

logger = logging.getLogger("rooflm.server")


class _Server(uvicorn.Server):
    """uvicorn's server, except that after a graceful stop on SIGTERM it exits normally (status 0) instead of
    re-raising the signal to die by it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.should_exit:
            print(f"rooflm serve: {signal.Signals(sig).name}: no new connections; finishing in-flight requests "
                  f"(up to {self.config.timeout_graceful_shutdown:g} s)", file=sys.stderr, flush=True)
        super().handle_exit(sig, frame)


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on accepted sockets whose proto says
    # TCP; with Nagle on, every small SSE chunk waits for the client's delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def run_server(args: argparse.Namespace) -> int:
    if args.max_waiting is not None and args.max_waiting < -1:
        raise ValueError(f"--max-waiting={args.max_waiting} is invalid: expected -1 (unbounded) or an integer >= 0")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout={args.shutdown_timeout} is invalid: expected a number >= 0")
    config = engine_config_from_args(args)
    sock = bind_socket(args.host, args.port)  # before loading: a taken port fails fast
    engine = AsyncLLMEngine.from_config(config, max_waiting=None if args.max_waiting == -1 else args.max_waiting)
    app = build_app(engine, api_key=args.api_key, served_model_name=args.served_model_name)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"rooflm serve: {app.state.serving.model_name} (max_model_len={engine.max_model_len}) on "
          f"http://{shown}:{port}", flush=True)
    uv_config = uvicorn.Config(app, log_level=args.log_level, access_log=args.log_level == "debug",
                               timeout_graceful_shutdown=args.shutdown_timeout, lifespan="on")
    _Server(uv_config).run(sockets=[sock])
    return 0
