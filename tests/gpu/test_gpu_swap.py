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


@pytest.mark.parametrize("mode", ["dma-runs", "uva", "auto"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_scattered_blocks_round_trip_through_pinned_memory(kv_cache_dtype, mode):
    """The asynchronous DMA path: runs of host blocks and single blocks, out and back on the side stream, with the
    device blocks overwritten in between by the compute stream."""
    from rooflm.attention.metadata_utils import allocate_kv_caches
    from rooflm.worker.swap_space import HostSwapSpace, _parts

    dev = torch.device("cuda")
    torch.manual_seed(0)
    caches = allocate_kv_caches(4, 64, 16, 8, 128, dtype=torch.float16, device=dev, kv_cache_dtype=kv_cache_dtype)
    for cache in caches:
        for part in _parts(cache):
            part.copy_(torch.randn(part.shape, device=dev).to(part.dtype))
    snapshot = [[p.clone() for p in _parts(c)] for c in caches]
    space = HostSwapSpace(80, 16, 8, 128, 4, torch.float16, kv_cache_dtype, dev)
    space.mode = mode
    assert mode != "uva" or space._views is not None, "the pinned pool has no device view: uva would not run"
    device_ids = [40, 3, 17, 18, 60, 9, 33]
    host_ids = [10, 11, 12, 70, 71, 5, 0]
    space.run(caches, list(zip(device_ids, host_ids)), [])
    for cache in caches:  # the compute stream reuses the blocks right away
        for part in _parts(cache):
            part[:, device_ids] = torch.zeros((), device=dev).to(part.dtype)
    targets = [1, 2, 50, 51, 52, 20, 63]
    space.run(caches, [], list(zip(host_ids, targets)))
    torch.cuda.synchronize()
    for cache, before in zip(caches, snapshot):
        for part, old in zip(_parts(cache), before):
            assert torch.equal(part[:, targets].view(torch.uint8), old[:, device_ids].view(torch.uint8))
