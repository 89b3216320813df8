"""The host side of swap preemption: a host copy of the KV pool's layout and the copies in and out of it.

``HostSwapSpace`` holds, per layer, host tensors shaped like the device cache but with ``num_host_blocks`` blocks
(pinned on CUDA, so host-to-device copies are asynchronous DMA transfers), plus the scales of a quantized cache. The
runner calls ``run(kv_caches, swap_out, swap_in)`` before a step's forward pass with the scheduler's block mappings
(``rooflm.kv_cache.swap``): swap-outs first, then swap-ins.

On CUDA the copies are issued on a side stream that first waits for the compute stream (the victim's KV may still
be being written by the step in flight), and the compute stream waits for the side stream before the forward pass
(the blocks a swap-out frees may be written by this step, and the blocks a swap-in fills are read by it). A
swap-out's device-to-host copy returns once the data is on the host, so a step that preempts by swapping waits for
the step before it: preemption steps give up the overlap of asynchronous scheduling, other steps keep it. On the CPU
the same code runs as plain copies.

``setup_swap`` wires both sides into an engine from ``EngineConfig.preemption_mode`` and ``swap_space``.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from rooflm.attention.kv_quant import SCALE_DTYPE, QuantizedKVCache, kv_storage_dtype
from rooflm.kv_cache.swap import DEFAULT_HOST_BANDWIDTH, SwapManager

if TYPE_CHECKING:
    from rooflm.engine.engine import LLMEngine

__all__ = ["HostSwapSpace", "setup_swap", "measure_host_bandwidth"]


def _parts(cache: torch.Tensor | QuantizedKVCache) -> list[torch.Tensor]:
    return [cache.data, cache.scales] if isinstance(cache, QuantizedKVCache) else [cache]


class HostSwapSpace:
    def __init__(self, num_host_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, num_layers: int,
                 model_dtype: torch.dtype, kv_cache_dtype: str, device: torch.device) -> None:
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        shape = (2, num_host_blocks, block_size, num_kv_heads, head_dim)
        dtype = kv_storage_dtype(kv_cache_dtype, model_dtype)
        # torch.empty: host pages are committed as blocks are first written, not up front (unless pinned)
        self.layers: list[list[torch.Tensor]] = []
        for _ in range(num_layers):
            parts = [torch.empty(shape, dtype=dtype, pin_memory=pin)]
            if kv_cache_dtype != "auto":
                parts.append(torch.empty(shape[:-1], dtype=SCALE_DTYPE, pin_memory=pin))
            self.layers.append(parts)
        self.stream = torch.cuda.Stream(self.device) if pin else None
        self.num_blocks_out = 0
        self.num_blocks_in = 0

    def run(self, kv_caches: list, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        if not swap_out and not swap_in:
            return
        if self.stream is None:
            self._copy(kv_caches, swap_out, swap_in)
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            self._copy(kv_caches, swap_out, swap_in)
        compute.wait_stream(self.stream)

    def _copy(self, kv_caches: list, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        dev = self.device
        if swap_out:
            d_idx = torch.tensor([d for d, _ in swap_out], device=dev)
            h_idx = torch.tensor([h for _, h in swap_out])
            for cache, host in zip(kv_caches, self.layers):
                for d, h in zip(_parts(cache), host):
                    h[:, h_idx] = d[:, d_idx].to("cpu")  # gathered on the device, one transfer per tensor
            self.num_blocks_out += len(swap_out)
        if swap_in:
            h_idx = torch.tensor([h for h, _ in swap_in])
            d_idx = torch.tensor([d for _, d in swap_in], device=dev)
            pin = dev.type == "cuda"
            for cache, host in zip(kv_caches, self.layers):
                for d, h in zip(_parts(cache), host):
                    src = h[:, h_idx]  # gathered on the host
                    if pin:
                        src = src.pin_memory()
                    d[:, d_idx] = src.to(dev, non_blocking=pin)
            self.num_blocks_in += len(swap_in)


def measure_host_bandwidth(device: torch.device, nbytes: int = 64 * 2**20) -> float:
    """Bytes per second of one pinned host-to-device copy of ``nbytes`` (CUDA), after a warm-up copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    return nbytes / max(time.perf_counter() - start, 1e-9)


def setup_swap(engine: "LLMEngine", bytes_per_block: int) -> None:
    """Give the engine's scheduler a ``SwapManager`` and its runner a ``HostSwapSpace`` of ``swap_space`` GiB, unless
    ``preemption_mode`` is "recompute". ``auto`` compares the live roofline's prefill time of a victim's context with
    the transfer time at the host link's bandwidth (measured on CUDA, assumed on the CPU)."""
    c = engine.config
    if c.preemption_mode == "recompute":
        return
    num_host_blocks = int(c.swap_space * 2**30) // bytes_per_block
    cfg = engine.model_config
    bandwidth = DEFAULT_HOST_BANDWIDTH.get(engine.device.type, DEFAULT_HOST_BANDWIDTH["cpu"])
    if c.preemption_mode == "auto" and engine.device.type == "cuda":
        bandwidth = measure_host_bandwidth(engine.device)
    roofline = engine.roofline
    engine.scheduler.swap = SwapManager(
        num_host_blocks, c.preemption_mode, bytes_per_block,
        recompute_seconds=lambda n: roofline.predict([n], [n], 1), bandwidth=bandwidth)
    engine.runner.swap_space = HostSwapSpace(num_host_blocks, c.block_size, cfg.num_key_value_heads, cfg.head_dim,
                                             cfg.num_hidden_layers, engine.dtype, c.kv_cache_dtype, engine.device)
