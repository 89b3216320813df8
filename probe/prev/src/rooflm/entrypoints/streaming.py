"""Stream requests' text to a terminal while the engine batches them, with llama.cpp-style timings, and Ctrl-C that
stops the generation between two engine steps (never in the middle of one, which would leave the engine's state
half-updated): the first Ctrl-C aborts what runs and keeps what was generated; a second one interrupts at once."""
from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import dataclass
from typing import Iterator, TextIO

from rooflm.engine.engine import LLMEngine
from rooflm.outputs import RequestOutput
from rooflm.sampling_params import SamplingParams


@contextlib.contextmanager
def stop_on_ctrl_c() -> Iterator[threading.Event]:
    """An event set by the first SIGINT; the second SIGINT raises KeyboardInterrupt as usual."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(sig: int, frame: object) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


@dataclass
class Timings:
    prompt_tokens: int = 0
    prompt_s: float = 0.0
    output_tokens: int = 0
    decode_s: float = 0.0

    def add(self, out: RequestOutput) -> None:
        m = out.metrics
        n_out = sum(len(c.token_ids) for c in out.outputs)
        self.prompt_tokens += len(out.prompt_token_ids)
        self.output_tokens += n_out
        if m is None or m.first_token_time is None:
            return
        self.prompt_s += m.first_token_time - (m.first_scheduled_time or m.arrival_time)
        if m.last_token_time is not None:
            self.decode_s += m.last_token_time - m.first_token_time

    def report(self) -> str:
        decoded = max(0, self.output_tokens - 1)  # the first token comes with the prompt evaluation

        def rate(tokens: int, seconds: float) -> str:
            if seconds <= 0 or tokens == 0:
                return "n/a"
            return f"{seconds * 1e3 / tokens:.2f} ms per token, {tokens / seconds:.2f} tokens per second"

        return (f"prompt eval time = {self.prompt_s * 1e3:10.2f} ms / {self.prompt_tokens:5d} tokens "
                f"({rate(self.prompt_tokens, self.prompt_s)})\n"
                f"       eval time = {self.decode_s * 1e3:10.2f} ms / {decoded:5d} tokens "
                f"({rate(decoded, self.decode_s)})")


def drive(engine: LLMEngine, watch: str | None = None, out: TextIO | None = None,
          stop: threading.Event | None = None, request_ids: list[str] | None = None) -> dict[str, RequestOutput]:
    """Step the engine until every request finishes, or until ``stop`` is set (then ``request_ids`` and every other
    unfinished request seen are aborted, and their latest outputs returned); stream ``watch``'s first sample to
    ``out`` as it grows."""
    latest: dict[str, RequestOutput] = {}
    shown = 0
    while engine.has_unfinished_requests():
        if stop is not None and stop.is_set():
            for rid in set(request_ids or ()) | {r for r, o in latest.items() if not o.finished}:
                if rid not in latest or not latest[rid].finished:
                    engine.abort_request(rid)
            while engine.has_unfinished_requests():  # let the aborts take effect
                for o in engine.step():
                    latest.setdefault(o.request_id, o)
            break
        for o in engine.step():
            latest[o.request_id] = o
            if o.request_id == watch and out is not None:
                text = o.outputs[0].text
                out.write(text[shown:])
                out.flush()
                shown = len(text)
    return latest


def stream_request(engine: LLMEngine, prompt: str | list[int], params: SamplingParams, out: TextIO,
                   stop: threading.Event | None = None) -> str:
    """Stream one request; returns its text (what was generated so far when ``stop`` was set)."""
    rid = engine.add_request(None, prompt, params)
    final = drive(engine, rid, out, stop, [rid]).get(rid)
    return final.outputs[0].text if final is not None else ""
