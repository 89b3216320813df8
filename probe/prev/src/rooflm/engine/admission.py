"""SLO-aware admission: refuse at once a request whose time to first token cannot meet ``ttft_slo_ms``.

A request that will miss its deadline anyway is better answered now (the server's 503, which a client or a load
balancer can retry elsewhere) than after it has waited, taken prefill compute from the others and timed out. The
prediction replays the scheduler's rule on the current queue, step by step, without running anything:

- every running request keeps its seat: an unfinished prompt takes its next chunk of the step's budget
  (``max_num_batched_tokens``), a decode one token, until its ``max_tokens`` are sampled (EOS cannot be foreseen, so
  this is an upper bound on the decodes);
- waiting requests are admitted in queue order while seats (``max_num_seqs``) and budget remain, and then the new
  request, last;
- each simulated step costs what the step-time predictor says of its composition (tokens and context per request,
  rows through the LM head). The engine's predictor is the live roofline's best possible time
  (``rooflm.roofline.live``) divided by a low quantile (``ADMISSION_QUANTILE``) of the fractions of it that recent
  steps reached (1 before the first step): an SLO is about the slow requests, and dividing by the mean fraction
  planned for the typical step, so on a machine whose step times swing (a busy CPU) admitted requests missed.

The predicted TTFT is the sum of the step times up to and including the step that completes the new request's
prompt, plus the steps already launched: the scheduler has accounted for those (their tokens count as computed), yet
a new request can join only the step after them, so each counts as one decode step of the running batch (exact for a
step that has just started, high by up to a step for one nearly done). Prefix-cache hits are not foreseen (the estimate is high for a request whose prompt is cached) and the KV pool
is assumed large enough (a preemption would only add time).

The client's TTFT also has time outside the engine's steps, and ``check`` adds it (docs/scheduling.md, "SLO-aware
admission"): the time since the server received the request (HTTP, tokenization, the wait for the step in flight,
since the engine thread takes new requests between steps), known exactly from the server's arrival stamp; and the
delivery of the first token from the engine's stamp to the client, learned as a recent high quantile
(``DELIVERY_QUANTILE``) of the deliveries the server reports. Measured on a busy CPU, the first was up to 280 ms
and the cause of the admitted requests that missed; the second a few ms.
"""
from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rooflm.engine.request import Request
    from rooflm.engine.scheduler import Scheduler

__all__ = ["SLORejectedError", "TTFTPredictor", "RecentQuantile", "FINISH_REJECTED", "ADMISSION_QUANTILE",
           "DELIVERY_QUANTILE"]

FINISH_REJECTED = "rejected"  # the finish reason of a request refused by admission (offline API)
ADMISSION_QUANTILE = 0.1  # steps are priced at the pace of the slowest tenth of recent steps
DELIVERY_QUANTILE = 0.9  # the time from the first token to its first byte sent is priced at its slowest tenth
RECENT_DELIVERIES = 64  # first-token deliveries ``DELIVERY_QUANTILE`` ranks: the recent pace of the server
StepTime = Callable[[list[int], list[int], int], float]  # (query_lens, context_lens, num_logit_rows) -> seconds


class SLORejectedError(RuntimeError):
    """The request's predicted time to first token exceeds ``ttft_slo_ms``: it was not queued."""

    def __init__(self, request_id: str, predicted_s: float, slo_s: float, outside_s: float = 0.0) -> None:
        outside = f", {outside_s * 1e3:.0f} ms of it outside the engine's steps" if outside_s else ""
        super().__init__(f"request {request_id!r} cannot meet ttft_slo_ms={slo_s * 1e3:g}: its predicted time to "
                         f"first token is at least {predicted_s * 1e3:.0f} ms with the current queue{outside}")
        self.request_id = request_id
        self.predicted_s = predicted_s
        self.slo_s = slo_s
        self.outside_s = outside_s  # the wait before the engine plus the expected delivery of the first token


class RecentQuantile:
    """The q-quantile (nearest rank) of the last ``window`` observations, 0 before the first. ``observe`` may be
    called from any thread (the server's event loop reports deliveries; the engine thread reads)."""

    def __init__(self, q: float, window: int) -> None:
        if not 0 < q <= 1:
            raise ValueError(f"q={q!r} is invalid: expected 0 < q <= 1")
        if window < 1:
            raise ValueError(f"window={window!r} is invalid: expected an integer >= 1")
        self.q = q
        self._recent: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        if not seconds >= 0:  # NaN or a clock that went backwards: nothing learned
            return
        with self._lock:
            self._recent.append(seconds)

    def __len__(self) -> int:
        return len(self._recent)

    def value(self) -> float:
        with self._lock:
            ordered = sorted(self._recent)
        return ordered[max(0, math.ceil(self.q * len(ordered)) - 1)] if ordered else 0.0


@dataclass
class _Sim:
    todo: int  # tokens to compute before its next sample (a prompt's rest, or the one token a decode feeds back)
    samples_left: int  # tokens it may still sample
    context: int = 0  # tokens with KV
    is_new: bool = False


class TTFTPredictor:
    """``predict(prompt_len, running, waiting)``: seconds until a new request of ``prompt_len`` tokens, queued last,
    has its first token. ``step_time`` gives one step's duration from its composition."""

    def __init__(self, step_time: StepTime, max_num_batched_tokens: int, max_num_seqs: int,
                 max_steps: int = 100_000) -> None:
        self.step_time = step_time
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_steps = max_steps
        # first token stamped by the engine -> its first byte sent by the server (reported by the server)
        self.delivery = RecentQuantile(DELIVERY_QUANTILE, RECENT_DELIVERIES)

    @staticmethod
    def _sim(req: "Request") -> _Sim:
        max_tokens = req.params.max_tokens
        samples = 10**9 if max_tokens is None else max_tokens - req.num_output_tokens
        # a token sampled but not read back yet (asynchronous scheduling) is computed by the next step
        return _Sim(max(1, req.num_tokens - req.num_computed_tokens), samples, req.num_computed_tokens)

    def predict(self, prompt_len: int, running: Iterable["Request"], waiting: Iterable["Request"],
                deadline_s: float = float("inf"), in_flight: int = 0) -> float:
        """Stops early (returning a value above ``deadline_s``) once the running sum passes the deadline.
        ``in_flight``: steps launched and not finished (see the module docstring)."""
        seats = [s for s in map(self._sim, running) if s.samples_left > 0]
        queue = [self._sim(r) for r in waiting] + [_Sim(prompt_len, 1, is_new=True)]
        total = 0.0
        if in_flight and seats:
            total = in_flight * self.step_time([1] * len(seats), [s.context for s in seats], len(seats))
        for _ in range(self.max_steps):
            budget = self.max_num_batched_tokens
            q_lens: list[int] = []
            c_lens: list[int] = []
            rows = 0
            done = False
            while queue and len(seats) < self.max_num_seqs:
                seats.append(queue.pop(0))
            for s in seats:
                if budget <= 0:
                    break
                n = min(s.todo, budget)
                budget -= n
                s.todo -= n
                s.context += n
                q_lens.append(n)
                c_lens.append(s.context)
                if s.todo == 0:  # this step samples for it
                    rows += 1
                    s.samples_left -= 1
                    s.todo = 1
                    done = done or s.is_new
            total += self.step_time(q_lens, c_lens, rows)
            if done or total > deadline_s:
                return total
            seats = [s for s in seats if s.samples_left > 0]
        return float("inf")

    def check(self, request_id: str, prompt_len: int, scheduler: "Scheduler", slo_s: float, in_flight: int = 0,
              waited_s: float = 0.0) -> float:
        """The predicted TTFT as the client sees it: ``waited_s`` (the time since the request arrived at the server:
        HTTP, tokenization, the wait for the step in flight), the engine's steps, and the recent high quantile of the
        delivery of a first token to the client (``delivery``). Raises ``SLORejectedError`` when it exceeds
        ``slo_s`` (with the time up to the first simulated step past the SLO: a lower bound of the prediction)."""
        outside = max(0.0, waited_s) + self.delivery.value()
        predicted = outside + self.predict(prompt_len, scheduler.running, scheduler.waiting,
                                           deadline_s=slo_s - outside, in_flight=in_flight)
        if predicted > slo_s:
            raise SLORejectedError(request_id, predicted, slo_s, outside)
        return predicted
