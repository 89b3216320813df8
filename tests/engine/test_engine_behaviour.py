"""Engine behaviours the server relies on, checked on the real engine (SmolLM2-135M-Instruct on the CPU) through the
public API only (LLM, LLMEngine.add_request / step / abort_request / get_stats, SamplingParams, RequestOutput):
stop strings, KV blocks freed after a finish, an abort or a consumer that goes away, logprobs, and the counters
that /metrics exports.

The server tests over the fake engine check only the server's plumbing of these behaviours."""
from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from engine_utils import run
from rooflm.engine.async_engine import AsyncLLMEngine
from rooflm.engine.engine import LLMEngine
from rooflm.sampling_params import SamplingParams

PROMPT = "Once upon a time, in a small village,"
HANG_TIMEOUT_S = 300.0  # only turns a hang into a failure; a CPU step takes well under a second


def assert_all_blocks_free(engine: LLMEngine) -> None:
    stats = engine.get_stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_total_blocks > 0 and stats.num_free_blocks == stats.num_total_blocks
    assert not engine.has_unfinished_requests()


# ------------------------------------------------------------------------------------------------------ stop strings
def test_stop_string_across_tokens_is_never_streamed(make_engine):
    """A stop string spanning two tokens ends the request at its first occurrence; no streamed output ever shows
    any of it, and every streamed text is a prefix of the final one."""
    engine = make_engine()
    tok = engine.tokenizer
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = run(engine, [PROMPT], base)[0].outputs[0]
    boundary = len(tok.decode(full.token_ids[:6]))  # the end of token 6 in the text
    stop = full.text[boundary - 2: boundary + 2]
    assert len(stop.strip()) >= 2, f"pick another boundary: {stop!r}"
    cut = full.text.index(stop)

    engine.add_request("s", PROMPT, base.clone(stop=[stop]))
    texts, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts.append(out.outputs[0].text)
            final = out
    assert final is not None and final.finished
    done = final.outputs[0]
    assert done.finish_reason == "stop" and done.stop_reason == stop
    assert done.text == full.text[:cut]
    assert all(stop not in t and done.text.startswith(t) for t in texts[:-1])
    assert len(done.token_ids) < len(full.token_ids)
    assert_all_blocks_free(engine)


# ------------------------------------------------------------------------------------------------------ KV blocks
def test_blocks_are_free_after_requests_finish(make_engine):
    engine = make_engine()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 17)]
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", f"{PROMPT} {i}", p)
    used_while_running = []
    while engine.has_unfinished_requests():
        engine.step()
        s = engine.get_stats()
        used_while_running.append(s.num_total_blocks - s.num_free_blocks)
    assert max(used_while_running) > 0  # the requests did hold blocks
    assert_all_blocks_free(engine)


def test_abort_frees_the_blocks_and_ends_the_request(make_engine):
    engine = make_engine()
    engine.add_request("long", PROMPT, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    engine.add_request("short", "The capital of France is", SamplingParams(temperature=0, max_tokens=4,
                                                                          ignore_eos=True))
    engine.step()
    engine.step()
    s = engine.get_stats()
    assert s.num_running == 2 and s.num_free_blocks < s.num_total_blocks
    engine.abort_request("long")
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "short"  # nothing more from the aborted request
            if out.finished:
                finished[out.request_id] = out
    assert len(finished["short"].outputs[0].token_ids) == 4
    assert_all_blocks_free(engine)


class PacedEngine:
    """The real engine behind a gate, so a test decides when it generates: without a permit ``step()`` returns
    no output (the caller still hands over adds and aborts between steps). Records aborts and finished requests."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._permits = threading.Semaphore(0)
        self._changed = threading.Condition()
        self.aborted: list[str] = []
        self.finished: list[str] = []

    def __getattr__(self, name: str) -> Any:  # config, tokenizer, max_model_len, ...
        return getattr(self._engine, name)

    def allow(self, steps: int = 1) -> None:
        self._permits.release(steps)

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams) -> None:
        self._engine.add_request(request_id, prompt, params)

    def has_unfinished_requests(self) -> bool:
        return self._engine.has_unfinished_requests()

    def get_stats(self):
        return self._engine.get_stats()

    def step(self):
        if not self._permits.acquire(timeout=0.005):
            return []
        outs = self._engine.step()
        with self._changed:
            self.finished += [o.request_id for o in outs if o.finished]
            self._changed.notify_all()
        return outs

    def abort_request(self, request_id: str) -> None:
        self._engine.abort_request(request_id)
        with self._changed:
            self.aborted.append(request_id)
            self._changed.notify_all()

    def wait_until(self, predicate, timeout: float = HANG_TIMEOUT_S) -> bool:
        with self._changed:
            return self._changed.wait_for(predicate, timeout)


def test_consumer_going_away_aborts_and_frees_the_blocks(make_engine):
    """A streaming consumer cancelled after its first output (a client that disconnects): the async engine aborts
    the request in the real engine, which frees its KV blocks; the request never runs to its end."""
    engine = make_engine()
    paced = PacedEngine(engine)
    async_engine = AsyncLLMEngine(paced)
    first_tokens: list[int] = []

    async def main() -> bool:
        got_first = asyncio.Event()

        async def consume() -> None:
            async for out in async_engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=200,
                                                                          ignore_eos=True), request_id="gone"):
                first_tokens.append(len(out.outputs[0].token_ids))
                got_first.set()

        task = asyncio.ensure_future(consume())
        paced.allow(1)  # one step: the prompt and the first token; then nothing moves until the consumer is gone
        await asyncio.wait_for(got_first.wait(), HANG_TIMEOUT_S)
        stats = engine.get_stats()
        assert stats.num_running == 1 and stats.num_free_blocks < stats.num_total_blocks
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await asyncio.to_thread(paced.wait_until, lambda: "gone" in paced.aborted)

    try:
        assert asyncio.run(asyncio.wait_for(main(), HANG_TIMEOUT_S))
    finally:
        async_engine.shutdown()
    assert paced.aborted == ["gone"] and paced.finished == [] and first_tokens == [1]
    assert async_engine.num_unfinished_requests == 0
    assert_all_blocks_free(engine)


# ------------------------------------------------------------------------------------------------------ logprobs
def test_greedy_token_is_its_own_top_logprob(make_engine):
    """With logprobs=1 the entry of each position holds the sampled token and the most likely one; greedy picks
    the most likely, so they are the same token and nothing else is reported."""
    engine = make_engine()
    c = run(engine, [PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1))[0].outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 8
    assert [list(d) for d in c.logprobs] == [[t] for t in c.token_ids]
    assert all(d[t] <= 0 for t, d in zip(c.token_ids, c.logprobs))
    assert c.cumulative_logprob == pytest.approx(sum(d[t] for t, d in zip(c.token_ids, c.logprobs)), abs=1e-4)


def test_no_logprobs_unless_asked(make_engine):
    engine = make_engine()
    c = run(engine, [PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].outputs[0]
    assert c.logprobs is None
    zero = run(engine, [PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0))[0]
    assert [list(d) for d in zero.outputs[0].logprobs] == [[t] for t in c.token_ids]  # the sampled token only


# ------------------------------------------------------------------------------------------------------ counters
def test_counters_after_known_traffic(make_engine):
    """The counters /metrics exports, after requests of known lengths (no prefix cache, so every prompt token is
    computed): prompt tokens, tokens generated, no preemption, every block free again."""
    engine = make_engine(enable_prefix_caching=False)
    tok = engine.tokenizer
    prompts = [tok(f"{PROMPT} {word}")["input_ids"] for word in ("alpha", "beta", "gamma")]
    max_tokens = [5, 7, 11]
    outs = run(engine, prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens])
    assert [len(o.outputs[0].token_ids) for o in outs] == max_tokens
    s = engine.get_stats()
    assert s.generation_tokens_total == sum(max_tokens)
    assert s.prompt_tokens_total == sum(len(p) for p in prompts)
    assert s.prefix_hits == 0 and s.num_preemptions == 0
    assert_all_blocks_free(engine)


def test_prompt_tokens_counter_excludes_prefix_cache_hits(make_engine):
    """A repeated prompt finds its whole blocks in the prefix cache (one token always left to compute); the
    prompt-token counter counts only what was computed."""
    engine = make_engine(enable_prefix_caching=True, block_size=16)
    repeated = engine.tokenizer(" ".join(["a long repeated prompt"] * 12))["input_ids"]
    assert len(repeated) > 33  # two full blocks and more
    run(engine, [repeated], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    run(engine, [repeated], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    s = engine.get_stats()
    full_blocks = (len(repeated) - 1) // 16 * 16
    assert s.prefix_hits == full_blocks
    assert s.generation_tokens_total == 5
    assert s.prompt_tokens_total == 2 * len(repeated) - full_blocks
    assert_all_blocks_free(engine)
