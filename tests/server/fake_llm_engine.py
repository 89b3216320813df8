"""A small, fast stand-in for ``LLMEngine`` honouring its contract, to test the async layer and the HTTP server
without loading a model. Tokens are bytes (id = byte + 3); generation is deterministic per (prompt, seed).

Tests that depend on the order of events pace the engine instead of sleeping: after ``hold()`` a step generates
only with a permit that the test hands out through ``allow(n)``; without one it returns no output, so the caller
keeps handing over adds and aborts while no request makes progress. ``release()`` ends the pacing, and
``wait_until(predicate)`` blocks until the engine's state satisfies the predicate. Waits time out only to turn a
hang into a failure."""
from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from rooflm.engine.stats import EngineStats
from rooflm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from rooflm.sampling_params import SamplingParams

_OFFSET = 3  # ids 0..2 are special: 0 pad, 1 bos, 2 eos
HANG_TIMEOUT_S = 60.0  # a wait_until longer than this is a hang, not slowness
_HELD_POLL_S = 0.005  # how long a held step waits for a permit before returning no output


class FakeTokenizer:
    eos_token_id = 2
    bos_token_id = 1
    eos_token = "</s>"

    def __len__(self) -> int:
        return 256 + _OFFSET

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + _OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - _OFFSET for i in ids if i >= _OFFSET).decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.decode([i]) for i in ids]

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = True,
                            **kwargs: object) -> str:
        text = "".join(f"<{m['role']}>{m.get('content') or ''}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def fake_logprobs(token_id: int, k: int) -> dict[int, float]:
    """The fake's logprobs of one position: the j-th letter of its alphabet gets -1 - j (the top-k), the sampled
    token -3 - (id % 4) / 2, below the top two, so the sampled token is rarely the most likely one."""
    d = {a: -1.0 - j for j, a in enumerate(FakeEngine._ALPHABET[:k])}
    d[token_id] = -3.0 - (token_id % 4) / 2
    return d


@dataclass
class FakeConfig:
    max_model_len: int = 128
    max_num_seqs: int = 8
    block_size: int = 16


@dataclass
class _Seq:
    index: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class _Req:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[_Seq]
    rng: random.Random
    metrics: RequestMetrics


class FakeEngine:
    """Round-robin 'decode': each step every running request gains one token per sample."""

    _ALPHABET = [ord(c) + _OFFSET for c in "abcdefgh ijklmnop"]

    def __init__(self, config: FakeConfig | None = None, step_delay: float = 0.002, num_blocks: int = 256,
                 fail_on_prompt: str | None = None) -> None:
        self.config = config or FakeConfig()
        self.tokenizer = FakeTokenizer()
        self.model_name = "fake-model"
        self.step_delay = step_delay
        self.num_blocks = num_blocks
        self.fail_on_prompt = fail_on_prompt  # a step with this prompt running raises (engine-death tests)
        self._running: dict[str, _Req] = {}
        self._waiting: list[_Req] = []
        self.num_steps = 0
        self.generation_tokens = 0
        self.prompt_tokens = 0
        self.aborted: list[str] = []
        self.added: list[str] = []  # request ids, in the order they were added
        self.params: dict[str, SamplingParams] = {}  # what each request was added with
        self.finished: list[str] = []  # request ids that ran to their end (stop or length)
        self.batches: list[list[str]] = []  # request ids stepped, one list per step
        self._gate: threading.Semaphore | None = None
        self._block: tuple[threading.Event, threading.Event] | None = None
        self._changed = threading.Condition()
        self._tokens_by_request: dict[str, int] = {}

    # ------------------------------------------------------------------ pacing (tests)
    def hold(self) -> None:
        """From now on a step generates only with a permit from ``allow``."""
        self._gate = threading.Semaphore(0)

    def allow(self, steps: int = 1) -> None:
        assert self._gate is not None, "hold() first"
        self._gate.release(steps)

    def release(self) -> None:
        """Stop pacing: steps run freely again (a step waiting for a permit goes on)."""
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.release()

    def block_next_step(self) -> tuple[threading.Event, threading.Event]:
        """The next step stops inside ``step()`` (the caller's thread is busy there): returns (entered, resume);
        the step goes on once the test sets ``resume``."""
        entered, resume = threading.Event(), threading.Event()
        self._block = (entered, resume)
        return entered, resume

    def wait_until(self, predicate: Callable[[], bool], timeout: float = HANG_TIMEOUT_S) -> bool:
        """Block until ``predicate()`` holds (checked after every add, step and abort); False on timeout."""
        with self._changed:
            return self._changed.wait_for(predicate, timeout)

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    # ------------------------------------------------------------------ contract
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if request_id in self._running or any(r.request_id == request_id for r in self._waiting):
            raise ValueError(f"request_id={request_id!r} is already in use")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.config.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, max_model_len={self.config.max_model_len}")
        seed = params.seed if params.seed is not None else hash(tuple(ids)) & 0xFFFF
        req = _Req(request_id, prompt if isinstance(prompt, str) else None, ids, params,
                   [_Seq(i) for i in range(params.n)], random.Random(seed),
                   RequestMetrics(arrival_time=arrival_time or time.monotonic()))
        self._waiting.append(req)
        self.added.append(request_id)
        self.params[request_id] = params
        self._notify()

    def has_unfinished_requests(self) -> bool:
        return bool(self._running or self._waiting)

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self._running.pop(request_id, None)
        self._waiting = [r for r in self._waiting if r.request_id != request_id]
        self._notify()

    def tokens_of(self, request_id: str) -> int:
        """Tokens generated so far for the request (over its samples), finished or not."""
        return self._tokens_by_request.get(request_id, 0)

    def step(self) -> list[RequestOutput]:
        block, self._block = self._block, None
        if block is not None:
            block[0].set()
            block[1].wait(HANG_TIMEOUT_S)
        gate = self._gate
        if gate is not None and not gate.acquire(timeout=_HELD_POLL_S):
            return []  # held: no progress, but the caller goes on taking adds and aborts between steps
        self.num_steps += 1
        if self.step_delay:
            time.sleep(self.step_delay)
        while self._waiting and self._num_running_seqs() + self._waiting[0].params.n <= self.config.max_num_seqs:
            req = self._waiting.pop(0)
            self._running[req.request_id] = req
            self.prompt_tokens += len(req.prompt_ids)
        outputs = []
        self.batches.append(list(self._running))
        for rid, req in list(self._running.items()):
            if self.fail_on_prompt is not None and req.prompt == self.fail_on_prompt:
                raise RuntimeError("injected engine failure")
            for seq in req.seqs:
                if seq.finish_reason is None:
                    self._grow(req, seq)
            finished = all(s.finish_reason for s in req.seqs)
            outputs.append(self._output(req, finished))
            if finished:
                del self._running[rid]
                self.finished.append(rid)
        self._notify()
        return outputs

    def get_stats(self) -> EngineStats:
        used = sum(self._blocks(r) for r in self._running.values())
        return EngineStats(
            num_running=self._num_running_seqs(),
            num_waiting=sum(r.params.n for r in self._waiting),
            kv_usage=used / self.num_blocks,
            num_free_blocks=self.num_blocks - used,
            num_total_blocks=self.num_blocks,
            prompt_tokens_total=self.prompt_tokens,
            generation_tokens_total=self.generation_tokens,
            num_steps=self.num_steps,
        )

    # ------------------------------------------------------------------ helpers
    def _num_running_seqs(self) -> int:
        return sum(r.params.n for r in self._running.values())

    def _blocks(self, req: _Req) -> int:
        bs = self.config.block_size
        return sum(math.ceil((len(req.prompt_ids) + len(s.token_ids)) / bs) for s in req.seqs)

    def _grow(self, req: _Req, seq: _Seq) -> None:
        p = req.params
        if p.temperature == 0:
            tok = self._ALPHABET[(len(req.prompt_ids) + len(seq.token_ids)) % len(self._ALPHABET)]
        else:
            tok = req.rng.choice(self._ALPHABET)
        seq.token_ids.append(tok)
        if req.metrics.first_token_time is None:  # as the real engine's output processor stamps it
            req.metrics.first_token_time = time.monotonic()
        self.generation_tokens += 1
        self._tokens_by_request[req.request_id] = self._tokens_by_request.get(req.request_id, 0) + 1
        text = self.tokenizer.decode(seq.token_ids)
        for s in p.stop:
            if s in text:
                seq.finish_reason, seq.stop_reason = "stop", s
                return
        limit = p.max_tokens if p.max_tokens is not None else self.config.max_model_len - len(req.prompt_ids)
        if len(seq.token_ids) >= limit or len(req.prompt_ids) + len(seq.token_ids) >= self.config.max_model_len:
            seq.finish_reason = "length"

    def _output(self, req: _Req, finished: bool) -> RequestOutput:
        outs = []
        for s in req.seqs:
            text = self.tokenizer.decode(s.token_ids)
            if s.finish_reason == "stop" and isinstance(s.stop_reason, str) and not req.params.include_stop_str_in_output:
                text = text[: text.index(s.stop_reason)]
            logprobs = None
            if req.params.logprobs is not None:
                logprobs = [fake_logprobs(t, req.params.logprobs) for t in s.token_ids]
            cumulative = sum(d[t] for t, d in zip(s.token_ids, logprobs)) if logprobs else None
            outs.append(CompletionOutput(s.index, text, list(s.token_ids), cumulative, logprobs, s.finish_reason,
                                         s.stop_reason))
        return RequestOutput(req.request_id, req.prompt, req.prompt_ids, outs, finished, metrics=req.metrics)
