"""Data parallelism: the router's choices, the merged stats, and replicas behind one server through the official
OpenAI client (fake engines, paced so that the order of events is fixed), plus two real replicas of the default
model giving the tokens one engine gives."""
from __future__ import annotations

import concurrent.futures
import os
import sys

import openai
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from fake_llm_engine import FakeConfig, FakeEngine  # noqa: E402
from server_helpers import InProcessServer  # noqa: E402

from rooflm.engine.async_engine import AsyncLLMEngine  # noqa: E402
from rooflm.engine.data_parallel import DataParallelEngine, DataParallelRouter, merge_stats  # noqa: E402
from rooflm.engine.stats import EngineStats  # noqa: E402


def test_router_sends_to_the_least_loaded_replica():
    loads = [3, 1, 2]
    router = DataParallelRouter(3, lambda i: loads[i], prefix_affinity=False)
    assert router.pick([5] * 40) == 1
    loads[1] = 9
    assert router.pick([5] * 40) == 2
    loads[:] = [4, 4, 4]
    assert router.pick("x") == 0  # ties: the lowest index


def test_router_prefers_the_replica_holding_the_prefix_within_the_slack():
    loads = [0, 0]
    router = DataParallelRouter(2, lambda i: loads[i], key_tokens=4, affinity_slack=2)
    shared = [7, 8, 9, 10]
    assert router.pick(shared + [1]) == 0
    loads[0] = 2  # two more than replica 1: still within the slack
    assert router.pick(shared + [2]) == 0
    assert router.pick([1, 2, 3, 4, 5]) == 1  # another prefix: the least loaded
    loads[0] = 5  # beyond the slack: locality gives way to balance
    assert router.pick(shared + [3]) == 1
    loads[:] = [0, 2]
    assert router.pick(shared + [4]) == 1  # the prefix moved with the last request
    assert router.pick([7, 8]) == 0  # shorter than a block: no prefix to share


def test_router_forgets_the_least_recently_used_prefix():
    router = DataParallelRouter(2, lambda i: 0, key_tokens=1, remember=2)
    for t in (1, 2, 3):
        router.pick([t])
    assert len(router._owner) == 2 and (1,) not in router._owner


def test_router_rejects_no_replicas():
    with pytest.raises(ValueError, match="num_replicas=0"):
        DataParallelRouter(0, lambda i: 0)


def test_merged_stats_add_counters_and_recompute_ratios():
    a = EngineStats(num_running=2, num_free_blocks=10, num_total_blocks=20, generation_tokens_total=5,
                    roofline_predicted_s=1.0, roofline_measured_s=2.0, roofline_bucket_counts=(1, 2))
    b = EngineStats(num_running=1, num_free_blocks=20, num_total_blocks=20, generation_tokens_total=7,
                    roofline_predicted_s=1.0, roofline_measured_s=4.0, roofline_bucket_counts=(0, 3))
    m = merge_stats([a, b])
    assert (m.num_running, m.generation_tokens_total, m.num_total_blocks) == (3, 12, 40)
    assert m.kv_usage == pytest.approx(10 / 40)
    assert m.roofline_fraction == pytest.approx(2 / 6)
    assert m.roofline_bucket_counts == (1, 5)


class _DPServer:
    def __init__(self, fakes: list[FakeEngine]) -> None:
        from rooflm.server.app import build_app

        self.fakes = fakes
        self.engine = DataParallelEngine([AsyncLLMEngine(f, max_waiting=64) for f in fakes], prefix_affinity=False)
        self.http = InProcessServer(build_app(self.engine, api_key=None))
        self.client = openai.OpenAI(base_url=self.http.url + "/v1", api_key="none", timeout=60, max_retries=0)


@pytest.fixture
def dp_server():
    fakes = [FakeEngine(FakeConfig(max_model_len=128, max_num_seqs=8), step_delay=0.0) for _ in range(2)]
    server = _DPServer(fakes)
    server.http.start()
    try:
        yield server
    finally:
        for f in fakes:
            f.release()
        server.http.stop()


def test_replicas_share_the_load_of_concurrent_clients(dp_server):
    for f in dp_server.fakes:
        f.hold()  # no request finishes until every one is admitted: each new one sees the others' load
    prompts = [f"prompt number {i}" for i in range(6)]

    def ask(p):
        return dp_server.client.completions.create(model="fake-model", prompt=p, max_tokens=4, temperature=0)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(ask, p) for p in prompts]
        assert all(f.wait_until(lambda f=f: len(f.added) == 3) for f in dp_server.fakes), \
            [len(f.added) for f in dp_server.fakes]
        for f in dp_server.fakes:
            f.release()
        texts = [fut.result().choices[0].text for fut in futures]
    assert all(len(t) > 0 for t in texts)
    assert dp_server.engine.num_unfinished_requests == 0
    assert dp_server.client.models.list().data[0].id == "fake-model"


def test_an_abort_reaches_the_replica_running_the_request(dp_server):
    busy, idle = dp_server.fakes
    busy.hold()
    # An abort from the server side leaves the client's response open (aborts normally come from a client that
    # went away), so this client gives up after a few seconds; how it ends is not what is tested here.
    client = dp_server.client.with_options(timeout=3)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(client.completions.create, model="fake-model", prompt="held on replica zero",
                          max_tokens=50)
        assert busy.wait_until(lambda: len(busy.added) == 1)
        request_id = busy.added[0]
        dp_server.engine.abort(request_id)
        assert busy.wait_until(lambda: request_id in busy.aborted)
        busy.release()
        try:
            fut.result()
        except (openai.APIError, openai.APITimeoutError):
            pass
    assert idle.added == [] and idle.aborted == []


def test_data_parallel_size_is_validated_and_refused_by_one_engine():
    from rooflm.config import EngineConfig
    from rooflm.engine.engine import LLMEngine

    with pytest.raises(ValueError, match="data_parallel_size"):
        EngineConfig(data_parallel_size=0)
    with pytest.raises(ValueError, match="data_parallel_size=2"):
        LLMEngine(EngineConfig(data_parallel_size=2))


def test_two_real_replicas_give_the_tokens_of_one_engine():
    """The default model twice behind the router: every request's greedy tokens equal a single engine's, and the
    requests were spread over both replicas."""
    import asyncio

    from rooflm.config import EngineConfig
    from rooflm.engine.engine import LLMEngine
    from rooflm.sampling_params import SamplingParams

    config = EngineConfig(data_parallel_size=2, quantization="none", max_num_seqs=4, show_progress=False)
    dp = DataParallelEngine.from_config(config)
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The sea was calm and"]
    params = SamplingParams(max_tokens=8, temperature=0)

    async def run_all():
        async def one(p):
            out = None
            async for out in dp.generate(p, params):
                pass
            return out.outputs[0].token_ids

        return await asyncio.gather(*(one(p) for p in prompts))

    try:
        got = asyncio.run(run_all())
        served = [r.engine.get_stats().prompt_tokens_total for r in dp.replicas]
    finally:
        dp.shutdown()
    single = LLMEngine(EngineConfig(quantization="none", max_num_seqs=4, show_progress=False))
    for i, p in enumerate(prompts):
        single.add_request(str(i), p, params)
    want: dict[str, list[int]] = {}
    while single.has_unfinished_requests():
        for out in single.step():
            if out.finished:
                want[out.request_id] = out.outputs[0].token_ids
    assert [list(t) for t in got] == [list(want[str(i)]) for i in range(len(prompts))]
    assert all(s > 0 for s in served), served
