"""Protection of the HTTP server against clients that hold connections without sending a request.

- ``HeaderTimeoutH11Protocol``: uvicorn's HTTP/1.1 protocol with a deadline on the request head. A connection that
  has not sent a complete request line and headers within ``header_timeout_s`` of connecting (or of the end of its
  previous response) is closed. uvicorn itself has no such deadline, so without it a client that sends one header
  byte a minute holds a socket and a file descriptor forever (the "slowloris" attack).
- ``RateLimitFilter``: a logging filter that lets each kind of message through at most once per interval and tells
  how many were dropped, so a flood of failing sockets writes a few lines, not a traceback per socket.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from uvicorn.protocols.http.h11_impl import H11Protocol


def header_timeout_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """A uvicorn ``http`` protocol class closing connections whose request head is late."""

    class HeaderTimeoutH11Protocol(H11Protocol):
        _head_deadline: Any = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._head_deadline = self.loop.call_later(header_timeout_s, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
                self._head_deadline = None

        def _head_timed_out(self) -> None:
            self._head_deadline = None
            if self.cycle is None or self.cycle.response_complete:  # no request in progress: drop it
                if not self.transport.is_closing():
                    self.transport.close()

        def handle_events(self) -> None:
            was_waiting = self.cycle is None or self.cycle.response_complete
            super().handle_events()
            if was_waiting and self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # a request head arrived

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's head has the same deadline (keep-alive timeout is shorter)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutH11Protocol


class RateLimitFilter(logging.Filter):
    """Let each (logger, message template) through at most once per ``interval_s``; the next one that passes says
    how many were suppressed in between. ``clock`` is injectable for tests."""

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[tuple[str, str], float] = {}
        self._suppressed: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        now = self.clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return False
            self._last[key] = now
            dropped = self._suppressed.pop(key, 0)
        if dropped:
            record.msg = f"{record.msg} ({dropped} more like this in the last {self.interval_s:g} s not logged)"
        return True


def install_rate_limit(interval_s: float = 10.0,
                       names: tuple[str, ...] = ("asyncio", "uvicorn.error", "rooflm.server.errors")) -> RateLimitFilter:
    """Rate-limit the loggers that a flood of bad connections writes to; returns the filter."""
    f = RateLimitFilter(interval_s)
    for name in names:
        logging.getLogger(name).addFilter(f)
    return f
