"""AsyncLLMEngine: the synchronous ``LLMEngine`` driven by one background thread, for asyncio callers (the server).

The engine is not thread-safe and ``step()`` is CPU/GPU-bound, so exactly one thread — the *engine thread* — ever
touches it. Callers on any asyncio loop talk to that thread through a command queue:

    caller (asyncio loop)                          engine thread
    ---------------------                          -------------
    generate() ── _AddCommand(future) ──────────►  engine.add_request()   (ValueError → the future)
               ◄── RequestOutput via loop.call_soon_threadsafe ◄─ engine.step() (each step's outputs)
    aclose()/cancel ── _AbortCommand ───────────►  engine.abort_request()

Invariants:
- The engine thread drains *all* pending commands before every step, so a request added while a step runs joins the
  running batch at the next step (continuous batching is the engine's business; we only never hold requests back).
- Commands are processed in submission order, so an abort submitted after an add always finds the request added.
- Every request's stream ends exactly once: with a ``finished`` output, an exception (engine died / shut down), or the
  caller leaving (then it is aborted and its KV blocks freed by the engine).
- ``stats`` is a snapshot taken by the engine thread after every step and every batch of commands; other threads read
  only the snapshot, never the engine.

No web framework is imported here: the engine core stays free of server dependencies.
"""
from __future__ import annotations

import asyncio
import collections
import copy
import concurrent.futures
import itertools
import logging
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol

from rooflm.engine.stats import EngineStats
from rooflm.outputs import RequestOutput
from rooflm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineProtocol(Protocol):
    """What AsyncLLMEngine needs from the synchronous engine (``rooflm.engine.engine.LLMEngine`` honours it)."""

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def abort_request(self, request_id: str) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def get_stats(self) -> EngineStats: ...


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down, or ``step()`` raised): no request can progress any more."""


class QueueFullError(RuntimeError):
    """Admitting the request would grow the waiting queue past ``max_waiting``: the caller should retry later."""


@dataclass
class _AddCommand:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    stream: "RequestStream"
    arrival_time: float | None = None  # time.monotonic() when the server received it (None: when added)
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class _AbortCommand:
    request_id: str


class RequestStream:
    """The per-request channel from the engine thread to the caller's asyncio loop."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, num_seqs: int) -> None:
        self.request_id = request_id
        self.loop = loop
        self.num_seqs = num_seqs  # sequences it counts for admission (its n samples)
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> bool:
        """Engine thread: hand an item to the caller's loop. False when that loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
            return True
        except RuntimeError:  # the caller's loop is closed: nobody will read this stream again
            return False


class AsyncLLMEngine:
    """Drive an ``LLMEngine`` from a background thread; ``generate()`` streams each request's cumulative outputs.

    ``max_waiting``: admission control. A request is refused with :class:`QueueFullError` (the server answers 503)
    when the admitted, unfinished sequences would exceed ``max_num_seqs + max_waiting``, i.e. when more than
    ``max_waiting`` sequences would wait for one of the ``max_num_seqs`` running slots. ``None`` admits everything.
    """

    def __init__(self, engine: EngineProtocol, *, max_waiting: int | None = None, max_num_seqs: int | None = None,
                 idle_poll_s: float = 0.5) -> None:
        if max_waiting is not None and (not isinstance(max_waiting, int) or max_waiting < 0):
            raise ValueError(f"max_waiting={max_waiting!r} is invalid: expected None or an integer >= 0")
        self.engine = engine
        self.max_waiting = max_waiting
        config = getattr(engine, "config", None)
        self.max_num_seqs: int = max_num_seqs or int(getattr(config, "max_num_seqs", 0) or 256)
        self._idle_poll_s = idle_poll_s

        self._commands: collections.deque[_AddCommand | _AbortCommand] = collections.deque()
        self._wakeup = threading.Event()
        self._lock = threading.RLock()  # guards _unfinished_seqs, _closed and appends to _commands
        self._streams: dict[str, RequestStream] = {}  # engine thread only (plus reads under _lock)
        self._unfinished_seqs = 0  # admitted sequences not finished yet (admission control)
        self._stop = False
        self._dead: BaseException | None = None
        self._closed = False  # set (under _lock) once the engine thread stopped taking commands
        self._stats: EngineStats = self._safe_stats() or EngineStats()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, config: Any, *, max_waiting: int | None = None) -> "AsyncLLMEngine":
        """Build the real engine (loads the model: slow) and wrap it."""
        from rooflm.engine.engine import LLMEngine

        return cls(LLMEngine(config), max_waiting=max_waiting)

    # ------------------------------------------------------------------------------------------------ engine facts
    @property
    def tokenizer(self) -> Any:
        return getattr(self.engine, "tokenizer", None)

    @property
    def model_name(self) -> str:
        return str(getattr(self.engine, "model_name", None) or "rooflm")

    @property
    def max_model_len(self) -> int:
        """The resolved limit (the engine's own attribute; its config may hold None for "auto")."""
        resolved = getattr(self.engine, "max_model_len", None)
        return int(resolved if resolved is not None else self.engine.config.max_model_len)  # type: ignore

    @property
    def stats(self) -> EngineStats:
        """The latest snapshot taken by the engine thread (never calls into the engine)."""
        return self._stats

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._streams)

    @property
    def num_unfinished_sequences(self) -> int:
        """Admitted sequences not finished yet (a request with n samples counts n): the load a router balances."""
        return self._unfinished_seqs

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    # ------------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="rooflm-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still running end with :class:`EngineDeadError`."""
        self._stop = True
        self._wakeup.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            stop = getattr(self.engine, "shutdown", None)  # tensor-parallel workers, if any
            if stop is not None:
                stop()

    # ------------------------------------------------------------------------------------------------ requests
    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its cumulative outputs until (and including) the finished one.

        Raises, before the first output: ``ValueError`` (the engine refused the input), :class:`QueueFullError`,
        :class:`EngineDeadError`. Closing or cancelling the generator early aborts the request.
        Outputs are cumulative, so when the caller falls behind only the newest one is yielded (nothing is lost).
        """
        stream = await self.add_request(prompt, params, request_id)
        async for out in self.iterate(stream):
            yield out

    async def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                          arrival_time: float | None = None) -> RequestStream:
        """Admit and add one request; returns its stream once the engine thread accepted it. ``arrival_time``
        (``time.monotonic()``): when the server received it, so the engine's TTFT (and SLO-aware admission) count the
        time spent before it reached the engine."""
        if self._thread is None:
            self.start()
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        num_seqs = int(getattr(params, "n", 1) or 1)
        stream = RequestStream(request_id, asyncio.get_running_loop(), num_seqs)
        self._admit(num_seqs)
        cmd = _AddCommand(request_id, prompt, params, stream, arrival_time)
        self._submit(cmd)
        try:
            await asyncio.wrap_future(cmd.done)
        except asyncio.CancelledError:
            # Either the engine thread has not taken the add yet (then the future is cancelled and it never will),
            # or it has: the abort, queued after the add, frees whatever the add took.
            self.abort(request_id)
            raise
        return stream

    async def iterate(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                while not stream.queue.empty():  # cumulative outputs: skip to the newest, keep exceptions
                    if isinstance(item, BaseException):
                        break
                    item = stream.queue.get_nowait()
                if isinstance(item, BaseException):
                    finished = True  # the engine thread already dropped this request
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(stream.request_id)

    def observe_first_token_delivery(self, request_id: str, seconds: float) -> None:
        """Thread-safe: the server sent a request's first token ``seconds`` after the engine stamped it
        (``RequestMetrics.first_token_time``). SLO-aware admission adds a recent high quantile of these to its
        predictions (``rooflm.engine.admission``); without admission this is a no-op."""
        admission = getattr(self.engine, "admission", None)
        if admission is not None:
            admission.delivery.observe(seconds)

    def abort(self, request_id: str) -> None:
        """Thread-safe, non-blocking: abort the request at the engine thread's next turn (no-op if finished)."""
        if self._thread is not None and not self._stop:
            self._submit(_AbortCommand(request_id))

    # ------------------------------------------------------------------------------------------------ internals
    def _admit(self, num_seqs: int) -> None:
        with self._lock:
            if self._dead is not None or self._stop:
                raise EngineDeadError(f"the engine is not running ({self._dead or 'shut down'})")
            if self.max_waiting is not None:
                # Sequences that would wait: those beyond the max_num_seqs the engine runs at once. (Not the
                # engine's own num_waiting: requests just added count there until the next step schedules them,
                # so a burst would be refused although it fits.)
                would_wait = self._unfinished_seqs + num_seqs - self.max_num_seqs
                if would_wait > self.max_waiting:
                    raise QueueFullError(
                        f"the waiting queue is full ({self.max_waiting} sequences may wait beyond "
                        f"{self.max_num_seqs} running); retry later"
                    )
            self._unfinished_seqs += num_seqs

    def _release(self, stream: RequestStream) -> None:
        with self._lock:
            self._unfinished_seqs -= stream.num_seqs

    def _submit(self, cmd: _AddCommand | _AbortCommand) -> None:
        with self._lock:
            if self._closed:  # the engine thread is gone: nobody will drain this command
                if isinstance(cmd, _AddCommand):
                    self._release(cmd.stream)
                    cmd.done.set_exception(EngineDeadError(f"the engine is not running ({self._dead})"))
                return
            self._commands.append(cmd)
        self._wakeup.set()

    def _safe_stats(self) -> EngineStats | None:
        try:
            return copy.copy(self.engine.get_stats())  # the engine may update its object in place
        except Exception:  # a stats bug must not kill the engine loop
            logger.exception("engine.get_stats() failed")
            return None

    def _run(self) -> None:
        """The engine thread."""
        try:
            while not self._stop:
                self._wakeup.clear()  # cleared *before* draining: a command submitted later sets it again
                if self._drain_commands():
                    self._stats = self._safe_stats() or self._stats
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._dispatch(outputs)
                    self._stats = self._safe_stats() or self._stats
                    if not outputs:  # a prefill chunk, or nothing schedulable: don't spin if it stays that way
                        self._wakeup.wait(0.001)
                else:
                    self._wakeup.wait(self._idle_poll_s)
        except BaseException as e:  # step() raised: every request in flight fails, new ones are refused
            logger.exception("the engine loop died")
            self._dead = e
        finally:
            if self._dead is None:
                self._dead = EngineDeadError("the engine was shut down")
            self._fail_everything()

    def _drain_commands(self) -> bool:
        did_any = False
        while self._commands:
            cmd = self._commands.popleft()
            did_any = True
            if isinstance(cmd, _AddCommand):
                if not cmd.done.set_running_or_notify_cancel():  # the caller gave up waiting: don't add it
                    self._release(cmd.stream)
                    continue
                try:
                    when = {} if cmd.arrival_time is None else {"arrival_time": cmd.arrival_time}
                    self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, **when)
                except Exception as e:  # ValueError: bad input; the caller maps it to a 400
                    self._release(cmd.stream)
                    cmd.done.set_exception(e)
                    continue
                self._streams[cmd.request_id] = cmd.stream
                cmd.done.set_result(None)
            else:
                stream = self._streams.pop(cmd.request_id, None)
                if stream is None:  # already finished (or never added): nothing to free
                    continue
                try:
                    self.engine.abort_request(cmd.request_id)
                except Exception:
                    logger.exception("abort_request(%s) failed", cmd.request_id)
                self._release(stream)
        return did_any

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted meanwhile: nobody listens
                continue
            delivered = stream.put(out)
            if out.finished or not delivered:
                del self._streams[out.request_id]
                self._release(stream)
                if not delivered and not out.finished:
                    try:
                        self.engine.abort_request(out.request_id)
                    except Exception:
                        logger.exception("abort_request(%s) failed", out.request_id)

    def _fail_everything(self) -> None:
        """Engine thread, on exit: end every open stream and refuse every queued add."""
        error = self._dead if isinstance(self._dead, EngineDeadError) else EngineDeadError(
            f"the engine loop died: {self._dead!r}")
        with self._lock:
            self._closed = True
            pending = list(self._commands)
            self._commands.clear()
        for stream in list(self._streams.values()):
            stream.put(error)
            self._release(stream)
        self._streams.clear()
        for cmd in pending:
            if isinstance(cmd, _AddCommand):
                self._release(cmd.stream)
                if cmd.done.set_running_or_notify_cancel():  # False: the caller already gave up
                    cmd.done.set_exception(error)
