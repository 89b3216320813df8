"""Swap preemption on the GPU (pinned host buffers, copies on a side stream), sync and async, with block_size 16
and 1: greedy tokens equal recompute mode's; every device and host block is free at the end. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _run(mode: str, async_scheduling: bool, block_size: int):
    from rooflm import LLM, SamplingParams

    blocks = 18 * 16 // block_size
    llm = LLM("smollm2-135m", load_format="dummy", dtype="float32", max_num_seqs=8, num_gpu_blocks_override=blocks,
              max_model_len=256, block_size=block_size, preemption_mode=mode, swap_space=0.05,
              async_scheduling=async_scheduling, show_progress=False)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 49152, (70 + 9 * i,), generator=g).tolist() for i in range(5)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    engine = llm.engine
    assert engine.get_stats().num_preemptions > 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    if engine.scheduler.swap is not None:
        sm = engine.scheduler.swap
        assert sm.stats.swap_outs > 0 and sm.num_free_host_blocks == sm.num_host_blocks
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("block_size", [16, 1])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_swap_equals_recompute_on_the_gpu(async_scheduling, block_size):
    assert _run("swap", async_scheduling, block_size) == _run("recompute", False, block_size)
