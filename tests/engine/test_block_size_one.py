"""Token-level KV (``block_size=1``, as in LightLLM's token attention): one token per block, so a request never holds
a partly filled block and the prefix cache matches prompts token by token. Greedy tokens equal those of the default
16-token blocks through batching, chunked prefill and prefix-cache hits."""
from __future__ import annotations

import pytest

from rooflm.sampling_params import SamplingParams

from engine_utils import run, tokens

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def shared_prefix_prompts(mixed_prompts) -> list[list[int]]:
    # prompts 0, 4, 8 share 40 tokens; 12 and 16 too; plus two unrelated ones
    return [mixed_prompts[i] for i in (0, 4, 8, 1, 12, 5, 16)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_block_size_one_equals_sixteen(make_engine, shared_prefix_prompts, async_scheduling):
    got = {}
    for bs in (16, 1):
        engine = make_engine(block_size=bs, max_num_batched_tokens=48, enable_prefix_caching=True,
                             async_scheduling=async_scheduling)
        got[bs] = tokens(run(engine, shared_prefix_prompts, GREEDY))
        # the same prompts again: now their prompts are cached, up to the last token
        again = run(engine, shared_prefix_prompts, GREEDY)
        assert tokens(again) == got[bs]
        if bs == 1:
            assert engine.kv.block_size == 1
            # token granularity: every prompt token but the last is a hit on the second pass
            assert [o.num_cached_tokens for o in again] == [len(p) - 1 for p in shared_prefix_prompts]
    assert got[1] == got[16]
    assert max(len(p) for p in shared_prefix_prompts) > 48, "no prompt was chunked"


def test_block_size_one_preemption_frees_every_block(make_engine, shared_prefix_prompts):
    ref = make_engine(block_size=1)
    want = tokens(run(ref, shared_prefix_prompts, GREEDY))
    small = make_engine(block_size=1, num_gpu_blocks_override=300, max_model_len=256, max_num_batched_tokens=64)
    assert tokens(run(small, shared_prefix_prompts, GREEDY)) == want
    assert small.get_stats().num_preemptions > 0, "the tiny pool forced no preemption"
