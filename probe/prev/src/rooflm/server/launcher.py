"""Run the app with uvicorn: load the model first, then listen.

Shutdown: the first SIGTERM/SIGINT stops accepting connections and lets in-flight requests finish for up to
``--shutdown-timeout`` seconds; requests still running then are cut cleanly (streams end with an error event and
``data: [DONE]``, waiting non-streaming requests get a 503), the engine stops and the process exits 0. A second
signal cuts at once and exits 1 without waiting for the engine thread: ``os._exit`` after flushing, because tearing
down the interpreter under a running compute thread can abort the process ("terminate called without an active
exception")."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from typing import Any, Iterator

import uvicorn

from rooflm.entrypoints.args import engine_config_from_args
from rooflm.engine.async_engine import AsyncLLMEngine
from rooflm.server.app import build_app
from rooflm.server.protection import header_timeout_protocol, install_rate_limit

logger = logging.getLogger("rooflm.server")

CUT_GRACE_S = 2.0  # after cutting, how long the cut requests get to write their last event
FORCED_EXIT_DEADLINE_S = 5.0  # after a second signal, exit by then whatever still runs


def _flush_and_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


class _Server(uvicorn.Server):
    """uvicorn's server with rooflm's shutdown: a cut instead of a cancellation when the grace period ends, exit 0
    after a graceful stop (instead of re-raising the signal), and a second signal that exits 1 at once."""

    def __init__(self, config: uvicorn.Config, serving: Any) -> None:
        super().__init__(config)
        self.serving = serving
        self.forced = False

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
        name = signal.Signals(sig).name
        if not self.should_exit:
            print(f"rooflm serve: {name}: no new connections; finishing in-flight requests "
                  f"(up to {self.config.timeout_graceful_shutdown:g} s; signal again to stop at once)",
                  file=sys.stderr, flush=True)
            self.should_exit = True
            return
        if not self.forced:
            print(f"rooflm serve: {name} again: stopping now", file=sys.stderr, flush=True)
            self.forced = self.force_exit = True
            timer = threading.Timer(FORCED_EXIT_DEADLINE_S, _flush_and_exit, args=(1,))
            timer.daemon = True
            timer.start()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        await asyncio.sleep(0.1)
        deadline = loop.time() + (self.config.timeout_graceful_shutdown or 0)
        while self.server_state.tasks and not self.force_exit and loop.time() < deadline:
            await asyncio.sleep(0.1)
        if self.server_state.tasks:
            self.serving.cut_streams()
            end = loop.time() + CUT_GRACE_S
            while self.server_state.tasks and loop.time() < end:
                await asyncio.sleep(0.05)
            for task in self.server_state.tasks:
                task.cancel()
        self.serving.stop_now = self.force_exit  # the lifespan then does not wait for the engine thread
        await self.lifespan.shutdown()


def bind_socket(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: expected a port number in [0, 65535] (0 picks a free one)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on accepted sockets whose proto says
    # TCP; with Nagle on, every small SSE chunk waits for the client's delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except (OSError, OverflowError) as e:
        sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot listen there: {getattr(e, 'strerror', None) or e}"
                         ) from None
    sock.set_inheritable(True)
    return sock


def check_server_args(args: argparse.Namespace) -> None:
    """Every server option checked before the model loads; messages name the flag."""
    if args.max_waiting is not None and args.max_waiting < -1:
        raise ValueError(f"--max-waiting {args.max_waiting}: expected -1 (unbounded) or an integer >= 0")
    for flag, value in (("--shutdown-timeout", args.shutdown_timeout),):
        if value < 0:
            raise ValueError(f"{flag} {value:g}: expected a number of seconds >= 0")
    for flag, value in (("--max-request-body-mb", args.max_request_body_mb), ("--header-timeout", args.header_timeout),
                        ("--body-timeout", args.body_timeout)):
        if not value > 0:
            raise ValueError(f"{flag} {value:g}: expected a number > 0")
    if args.limit_concurrency is not None and args.limit_concurrency < 1:
        raise ValueError(f"--limit-concurrency {args.limit_concurrency}: expected an integer >= 1")


def run_server(args: argparse.Namespace) -> int:
    check_server_args(args)
    config = engine_config_from_args(args)
    sock = bind_socket(args.host, args.port)  # before loading: a taken port fails fast
    max_waiting = None if args.max_waiting == -1 else args.max_waiting
    if config.data_parallel_size > 1:
        from rooflm.engine.data_parallel import DataParallelEngine

        engine = DataParallelEngine.from_config(config, max_waiting=max_waiting)
    else:
        engine = AsyncLLMEngine.from_config(config, max_waiting=max_waiting)
    app = build_app(engine, api_key=args.api_key, served_model_name=args.served_model_name,
                    max_body_mb=args.max_request_body_mb, body_timeout_s=args.body_timeout,
                    tool_call_parser=args.tool_call_parser)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"rooflm serve: {app.state.serving.model_name} (max_model_len={engine.max_model_len}) on "
          f"http://{shown}:{port}", flush=True)
    uv_config = uvicorn.Config(app, log_level=args.log_level, access_log=args.log_level == "debug",
                               timeout_graceful_shutdown=args.shutdown_timeout, lifespan="on",
                               http=header_timeout_protocol(args.header_timeout),
                               limit_concurrency=args.limit_concurrency)
    if args.log_level == "debug":  # rooflm's own debug lines too (e.g. each admitted request's predicted TTFT)
        logging.getLogger("rooflm").setLevel(logging.DEBUG)
    install_rate_limit()
    server = _Server(uv_config, app.state.serving)
    server.run(sockets=[sock])
    if server.forced:
        _flush_and_exit(1)
    return 0
