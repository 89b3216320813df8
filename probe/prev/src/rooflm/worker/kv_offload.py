"""The runner's side of the prefix cache's host tier (``kv_offload_gb``; the scheduler's side is
``rooflm.kv_cache.host_tier``).

The host buffer and its copies are swap preemption's (``HostSwapSpace``): per layer a host tensor shaped like the
device cache with as many blocks as ``kv_offload_gb`` holds (pinned on CUDA, so the copies are DMA transfers on a side
stream), and one gather on the source and one scatter on the destination per layer and step, however many blocks
move. The runner calls ``run`` twice per step: offloads before the swap copies, restores after them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from rooflm.kv_cache.host_tier import HostPrefixTier
from rooflm.worker.swap_space import HostSwapSpace

if TYPE_CHECKING:
    from rooflm.engine.engine import LLMEngine

__all__ = ["setup_kv_offload"]


def setup_kv_offload(engine: "LLMEngine", bytes_per_block: int) -> None:
    """Give the engine a host tier of ``kv_offload_gb`` GiB: the scheduler's ``HostPrefixTier``, fed by the block
    pool's evictions, and the runner's ``HostSwapSpace``. Nothing when ``kv_offload_gb`` is 0."""
    c = engine.config
    if not c.kv_offload_gb:
        return
    num_host_blocks = int(c.kv_offload_gb * 2**30) // bytes_per_block
    if num_host_blocks < 1:
        raise ValueError(f"kv_offload_gb={c.kv_offload_gb} holds no KV block: one block of {c.block_size} tokens "
                         f"takes {bytes_per_block} bytes for this model")
    tier = HostPrefixTier(num_host_blocks, c.block_size, bytes_per_block)
    engine.scheduler.host_tier = tier
    engine.kv.block_pool.on_evict = tier.offload
    engine.kv.host_tier = tier
    cfg = engine.runner.cfg  # this rank's KV heads
    engine.runner.kv_offload = HostSwapSpace(num_host_blocks, c.block_size, cfg.num_key_value_heads, cfg.head_dim,
                                             cfg.num_hidden_layers, engine.dtype, c.kv_cache_dtype, engine.device)
