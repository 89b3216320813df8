"""AsyncLLMEngine over the fake engine: batching, aborts, admission control, engine death, shutdown."""
from __future__ import annotations

import asyncio

import pytest
from fake_llm_engine import FakeConfig, FakeEngine

from rooflm.engine.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError
from rooflm.sampling_params import SamplingParams

T = 60  # seconds: upper bound of every wait below, only to turn a hang into a failure


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, T))


def greedy(n: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n)


async def collect(agen) -> list:
    return [o async for o in agen]


def test_generate_streams_cumulative_outputs_until_finished():
    fake = FakeEngine()
    eng = AsyncLLMEngine(fake)

    async def main():
        outs = [o async for o in eng.generate("hello", greedy(5))]
        return outs

    try:
        outs = _run(main())
    finally:
        eng.shutdown()
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    texts = [o.outputs[0].text for o in outs]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative: only grows
    assert len(outs[-1].outputs[0].token_ids) == 5 and outs[-1].outputs[0].finish_reason == "length"
    assert eng.num_unfinished_requests == 0


def test_request_added_later_joins_the_running_batch():
    """A request arriving while another runs is stepped together with it (no waiting for the first to end)."""
    fake = FakeEngine(step_delay=0)
    fake.hold()
    fake.allow(1)  # "a" gets one token, then nothing progresses until "b" has been handed to the engine
    eng = AsyncLLMEngine(fake)

    async def main():
        a_started = asyncio.Event()

        async def first():
            outs = []
            async for o in eng.generate("a", greedy(40), request_id="a"):
                outs.append(o)
                a_started.set()
            return outs

        a_task = asyncio.ensure_future(first())
        await asyncio.wait_for(a_started.wait(), T)
        b_task = asyncio.ensure_future(collect(eng.generate("b", greedy(3), request_id="b")))
        assert await asyncio.to_thread(fake.wait_until, lambda: "b" in fake.added)
        assert fake.tokens_of("a") == 1
        fake.release()
        return await a_task, await b_task

    try:
        a, b = _run(main())
    finally:
        fake.release()
        eng.shutdown()
    assert b[-1].finished and a[-1].finished and len(a[-1].outputs[0].token_ids) == 40
    joint = [batch for batch in fake.batches if set(batch) == {"a", "b"}]
    assert len(joint) == 3  # "b" ran its 3 tokens inside "a"'s batch
    assert fake.finished == ["b", "a"]


def test_closing_the_generator_aborts_the_request():
    fake = FakeEngine(step_delay=0)
    fake.hold()
    fake.allow(1)
    eng = AsyncLLMEngine(fake)

    async def main():
        gen = eng.generate("hello", greedy(100), request_id="r")
        async for out in gen:
            break
        await gen.aclose()  # queues the abort; the held engine takes it without generating more
        return await asyncio.to_thread(fake.wait_until, lambda: not fake.has_unfinished_requests())

    try:
        assert _run(main())
    finally:
        fake.release()
        eng.shutdown()
    assert fake.aborted == ["r"] and fake.finished == []
    assert fake.tokens_of("r") == 1
    assert eng.num_unfinished_requests == 0 and eng._unfinished_seqs == 0
    stats = fake.get_stats()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks


def test_cancelled_consumer_aborts_the_request():
    """Cancelling the task that consumes a request's outputs aborts that request in the engine: it never runs to
    its end and holds no KV block afterwards."""
    fake = FakeEngine(step_delay=0)
    fake.hold()
    fake.allow(1)  # one step: the first token; then no progress, so the request cannot finish by itself
    eng = AsyncLLMEngine(fake)

    async def main():
        got_first = asyncio.Event()

        async def consume():
            async for _ in eng.generate("x", greedy(100), request_id="victim"):
                got_first.set()

        task = asyncio.ensure_future(consume())
        await asyncio.wait_for(got_first.wait(), T)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await asyncio.to_thread(fake.wait_until, lambda: "victim" in fake.aborted)

    try:
        assert _run(main())
    finally:
        fake.release()
        eng.shutdown()
    assert fake.aborted == ["victim"] and "victim" not in fake.finished
    assert fake.tokens_of("victim") == 1
    assert not fake.has_unfinished_requests() and eng.num_unfinished_requests == 0
    stats = fake.get_stats()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks


def test_add_request_value_error_reaches_the_caller():
    eng = AsyncLLMEngine(FakeEngine(FakeConfig(max_model_len=8)))

    async def main():
        with pytest.raises(ValueError, match="max_model_len=8"):
            async for _ in eng.generate("this prompt is too long", greedy()):
                pass

    try:
        _run(main())
    finally:
        eng.shutdown()
    assert eng._unfinished_seqs == 0  # the refused request holds no admission slot


def test_full_waiting_queue_raises_queue_full_at_once():
    """Admission is decided when the request arrives: with the engine held (nothing can finish), the request past
    ``max_num_seqs + max_waiting`` is refused, and the slots come back once the admitted ones are aborted."""
    fake = FakeEngine(FakeConfig(max_num_seqs=2), step_delay=0)
    fake.hold()
    eng = AsyncLLMEngine(fake, max_waiting=1)

    async def main():
        streams = [await eng.add_request("p", greedy(50)) for _ in range(3)]  # 2 run, 1 waits
        with pytest.raises(QueueFullError, match="waiting queue is full"):
            await eng.add_request("p", greedy(50))
        ids = [s.request_id for s in streams]
        for rid in ids:
            eng.abort(rid)
        assert await asyncio.to_thread(fake.wait_until, lambda: sorted(fake.aborted) == sorted(ids))
        stream = await eng.add_request("p", greedy(2))  # admitted again
        fake.release()
        return [o async for o in eng.iterate(stream)]

    try:
        outs = _run(main())
    finally:
        fake.release()
        eng.shutdown()
    assert outs[-1].finished and fake.generation_tokens == 2  # only the last request generated


def test_engine_death_fails_running_requests_and_refuses_new_ones():
    fake = FakeEngine(fail_on_prompt="boom")
    eng = AsyncLLMEngine(fake)

    async def main():
        with pytest.raises(EngineDeadError):
            async for _ in eng.generate("boom", greedy()):
                pass
        with pytest.raises(EngineDeadError):
            await eng.add_request("fine", greedy())

    try:
        _run(main())
    finally:
        eng.shutdown()
    assert not eng.is_running


def test_shutdown_ends_open_streams():
    fake = FakeEngine(step_delay=0)
    fake.hold()  # the request cannot finish before the shutdown
    eng = AsyncLLMEngine(fake)

    async def main():
        stream = await eng.add_request("x", greedy(100))
        await asyncio.to_thread(eng.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in eng.iterate(stream):
                pass

    _run(main())


def test_caller_cancelled_before_the_add_was_taken_leaves_the_engine_healthy():
    """The add's future is cancelled while the engine thread is busy in a step: the thread must skip that add
    (a cancelled future cannot take a result) and keep running."""
    fake = FakeEngine(step_delay=0)
    entered, resume = fake.block_next_step()
    eng = AsyncLLMEngine(fake)

    async def main():
        busy = await eng.add_request("a", greedy(3), request_id="a")
        assert await asyncio.to_thread(entered.wait, T)  # the engine thread is now inside step()
        task = asyncio.ensure_future(eng.add_request("b", greedy(3), request_id="late"))
        await asyncio.sleep(0)  # the task runs up to waiting for the engine thread: its add is queued
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        resume.set()
        outs = [o async for o in eng.iterate(busy)]
        later = [o async for o in eng.generate("c", greedy(2), request_id="c")]
        return outs, later, eng.is_running

    try:
        outs, later, alive = _run(main())
    finally:
        resume.set()
        eng.shutdown()
    assert alive and outs[-1].finished and later[-1].finished and not fake.has_unfinished_requests()
    assert fake.added == ["a", "c"]  # the cancelled add was skipped, not added and then aborted
    assert eng._unfinished_seqs == 0
