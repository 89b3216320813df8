"""The prefix cache's host tier on the GPU (pinned host buffers, copies on a side stream), sync and async, block sizes
16 and 1: greedy tokens equal a pool too small to keep the prefixes without the tier, prefixes come back from the
host, nothing leaks; and H2O KV compression on the GPU path (its scores computed in torch beside the Triton
attention): a budget holding the whole sequence changes nothing. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _prompts(bs: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(100, 49000, (64,), generator=g).tolist() for _ in range(4)]
    tails = [torch.randint(100, 49000, (5 + j,), generator=g).tolist() for j in range(8)]
    return [docs[i] + tails[r * 4 + i] for r in range(2) for i in range(4)]


def _run(gb: float, async_scheduling: bool, block_size: int, **kw):
    from rooflm import LLM, SamplingParams

    llm = LLM("smollm2-135m", load_format="dummy", dtype="float32", max_num_seqs=1, block_size=block_size,
              num_gpu_blocks_override=8 * 16 // block_size, max_model_len=128, kv_offload_gb=gb,
              async_scheduling=async_scheduling, show_progress=False, **kw)
    outs = llm.generate(_prompts(block_size), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    engine = llm.engine
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return [o.outputs[0].token_ids for o in outs], engine


@pytest.mark.parametrize("block_size", [16, 1])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_host_tier_equals_recompute_on_cuda(async_scheduling, block_size):
    want, rec = _run(0, async_scheduling, block_size)
    assert rec.get_stats().prefix_hits < 4 * 64, "the small pool kept every prefix"
    got, off = _run(0.05, async_scheduling, block_size)
    assert got == want
    tier = off.scheduler.host_tier
    assert off.runner.kv_offload.layers[0][0].is_pinned()
    s = off.get_stats()  # every document's second question: its 64 tokens from the device or the host
    assert s.host_cache_hits > 0 and s.host_cache_hits + s.prefix_hits == 4 * 64
    assert tier.num_free_host_blocks + tier.num_cached_blocks == tier.num_host_blocks


def test_h2o_budget_covering_the_sequence_equals_no_compression_on_cuda():
    from rooflm import LLM, SamplingParams

    llm = LLM("smollm2-135m", load_format="dummy", dtype="float32", show_progress=False, async_scheduling=False)
    prompts = _prompts(16)[:3]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    h2o = params.clone(kv_compression={"method": "h2o", "budget": 128})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, h2o, use_tqdm=False)] == plain
    small = params.clone(kv_compression={"method": "h2o", "budget": 48, "recent": 16})
    outs = llm.generate(prompts, small, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
