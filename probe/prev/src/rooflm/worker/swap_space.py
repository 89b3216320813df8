"""The host side of swap preemption: a host copy of the KV pool's layout and the copies in and out of it.

``HostSwapSpace`` holds, per layer, host tensors shaped like the device cache but with ``num_host_blocks`` blocks
(pinned on CUDA, so host-to-device copies are asynchronous DMA transfers), plus the scales of a quantized cache. The
runner calls ``run(kv_caches, swap_out, swap_in)`` before a step's forward pass with the scheduler's block mappings
(``rooflm.kv_cache.swap``): swap-outs first, then swap-ins.

On CUDA the copies are issued on a side stream that first waits for the compute stream (the victim's KV may still
be being written by the step in flight), and the compute stream waits for the side stream before the forward pass
(the blocks a swap-out frees may be written by this step, and the blocks a swap-in fills are read by it). Each copy
moves a run of consecutive host blocks (``host_runs``; the host pool hands out its lowest free ids, so a request's
blocks are mostly one run) as one DMA transfer between the pinned buffer and a device gather, in both directions,
so neither the host nor the caller waits for it: no host-side gather, no staging copy, no synchronisation. On the
CPU the same code runs as plain copies.

``setup_swap`` wires both sides into an engine from ``EngineConfig.preemption_mode`` and ``swap_space``.
"""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import torch

from rooflm.attention.kv_quant import SCALE_DTYPE, QuantizedKVCache, kv_storage_dtype
from rooflm.kv_cache.swap import DEFAULT_HOST_BANDWIDTH, SwapManager

if TYPE_CHECKING:
    from rooflm.engine.engine import LLMEngine

__all__ = ["HostSwapSpace", "setup_swap", "measure_host_bandwidth", "host_link_bandwidth", "host_runs",
           "cuda_view_of_pinned", "COPY_MODES"]

COPY_MODES = ("auto", "dma-runs", "uva")
# How CUDA copies move blocks (the CPU always copies directly): "dma-runs", one copy-engine transfer per run of
# consecutive host blocks, per layer and K/V half; "uva", one gather or scatter kernel per layer that reads or writes
# the pinned pool through its device address (unified virtual addressing), however scattered the blocks are;
# "auto", dma-runs when the runs are long enough for each transfer to outlast the host's cost of issuing it, else uva.
# Measured on an H100 (PCIe 5.0, Llama-2-7B blocks of 128 KiB per layer half): DMA reaches 46-48 GB/s on long runs but
# 7-8 GB/s on single blocks (issuing ~10^4 small copies), the kernels 37-40 GB/s out and 24-26 GB/s in at any scatter.
DEFAULT_COPY_MODE = os.environ.get("ROOFLM_HOST_COPY", "auto")
DMA_MIN_COPY_BYTES = 1 << 20  # "auto" uses DMA when a run's transfer averages at least this many bytes


def _parts(cache: torch.Tensor | QuantizedKVCache) -> list[torch.Tensor]:
    return [cache.data, cache.scales] if isinstance(cache, QuantizedKVCache) else [cache]


class HostSwapSpace:
    def __init__(self, num_host_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, num_layers: int,
                 model_dtype: torch.dtype, kv_cache_dtype: str, device: torch.device) -> None:
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        if pin and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
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
        self.mode = DEFAULT_COPY_MODE
        if self.mode not in COPY_MODES:
            raise ValueError(f"ROOFLM_HOST_COPY={self.mode!r} is invalid: expected one of {COPY_MODES}")
        # byte views of the pinned pool in device memory space, for the "uva" mode's kernels
        self._views = [[cuda_view_of_pinned(h) for h in parts] for parts in self.layers] if pin else None
        if self._views is not None and self._views[0][0].device != self.device:
            self._views = None  # pinned by another device's context: torch would not mix the two in one kernel
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
        if self._views is not None and self._use_uva(kv_caches, swap_out, swap_in):
            self._copy_uva(kv_caches, swap_out, swap_in)
            return
        dev = self.device
        if swap_out:
            d_idx = torch.tensor([d for d, _ in swap_out], device=dev)
            runs = host_runs([h for _, h in swap_out])
            for cache, host in zip(kv_caches, self.layers):
                for d, h in zip(_parts(cache), host):
                    gathered = d[:, d_idx]  # [2, n, ...], contiguous on the device
                    _transfer(h, gathered, runs, to_host=True)
            self.num_blocks_out += len(swap_out)
        if swap_in:
            d_idx = torch.tensor([d for _, d in swap_in], device=dev)
            runs = host_runs([h for h, _ in swap_in])
            for cache, host in zip(kv_caches, self.layers):
                for d, h in zip(_parts(cache), host):
                    staged = torch.empty((2, len(swap_in)) + tuple(d.shape[2:]), dtype=d.dtype, device=dev)
                    _transfer(h, staged, runs, to_host=False)
                    d[:, d_idx] = staged
            self.num_blocks_in += len(swap_in)


    def _use_uva(self, kv_caches: list, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> bool:
        if self.mode != "auto":
            return self.mode == "uva"
        n = len(swap_out) + len(swap_in)
        runs = len(host_runs([h for _, h in swap_out])) + len(host_runs([h for h, _ in swap_in]))
        half_block = _parts(kv_caches[0])[0][0, 0].nbytes  # one block's K (or V) of one layer
        return n * half_block < DMA_MIN_COPY_BYTES * runs

    def _copy_uva(self, kv_caches: list, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        dev = self.device
        if swap_out:
            d_idx = torch.tensor([d for d, _ in swap_out], device=dev)
            h_idx = torch.tensor([h for _, h in swap_out], device=dev)
            for cache, views in zip(kv_caches, self._views):
                for d, v in zip(_parts(cache), views):
                    v.index_copy_(1, h_idx, _bytes(d).index_select(1, d_idx))
            self.num_blocks_out += len(swap_out)
        if swap_in:
            h_idx = torch.tensor([h for h, _ in swap_in], device=dev)
            d_idx = torch.tensor([d for _, d in swap_in], device=dev)
            for cache, views in zip(kv_caches, self._views):
                for d, v in zip(_parts(cache), views):
                    _bytes(d).index_copy_(1, d_idx, v.index_select(1, h_idx))
            self.num_blocks_in += len(swap_in)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


class _CudaArray:
    """An object exposing ``__cuda_array_interface__`` (version 2) for a contiguous byte range."""

    def __init__(self, ptr: int, shape: tuple[int, ...]) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "|u1", "data": (ptr, False), "version": 2,
                                         "strides": None}


def cuda_view_of_pinned(t: torch.Tensor) -> torch.Tensor:
    """A CUDA byte tensor aliasing the pinned host tensor ``t`` (its last dimension in bytes). Under unified virtual
    addressing a pinned host page has one address for host and device, so kernels can read and write it directly
    over the bus (zero-copy). The view does not own the memory: keep ``t`` alive as long as the view is used."""
    if not t.is_pinned() or not t.is_contiguous():
        raise ValueError("cuda_view_of_pinned needs a contiguous pinned host tensor")
    b = _bytes(t)
    view = torch.as_tensor(_CudaArray(b.data_ptr(), tuple(b.shape)))  # torch asks CUDA which device maps it
    if view.data_ptr() != b.data_ptr():
        raise RuntimeError("cuda_view_of_pinned: torch copied the pinned buffer instead of aliasing it")
    return view


def host_runs(host_ids: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive host block ids: ``(first host id, position in host_ids, length)``. A run of a host
    tensor's K (or V) half is one contiguous range, so it moves as a single DMA transfer straight from or into the
    pinned buffer, without a gather or a staging copy on the host."""
    runs: list[tuple[int, int, int]] = []
    for pos, h in enumerate(host_ids):
        if runs and runs[-1][0] + runs[-1][2] == h:
            first, at, n = runs[-1]
            runs[-1] = (first, at, n + 1)
        else:
            runs.append((h, pos, 1))
    return runs


def _transfer(host: torch.Tensor, dev: torch.Tensor, runs: list[tuple[int, int, int]], to_host: bool) -> None:
    """Copy ``dev`` ([2, n, ...], blocks in mapping order) to or from ``host`` ([2, num_host_blocks, ...]) run by
    run. Pinned host memory makes each copy asynchronous on the current (side) stream; the device tensor stays
    alive until the copy is done because the caching allocator reuses it only for later work on the same stream."""
    non_blocking = host.is_pinned()
    for kv in range(2):
        for first, at, n in runs:
            h, d = host[kv, first:first + n], dev[kv, at:at + n]
            if to_host:
                h.copy_(d, non_blocking=non_blocking)
            else:
                d.copy_(h, non_blocking=non_blocking)


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


def host_link_bandwidth(device: torch.device, measure: bool = True) -> float:
    """Host <-> device bytes per second: measured on CUDA (``measure``), else the assumed ``DEFAULT_HOST_BANDWIDTH``."""
    if measure and device.type == "cuda":
        return measure_host_bandwidth(device)
    return DEFAULT_HOST_BANDWIDTH.get(device.type, DEFAULT_HOST_BANDWIDTH["cpu"])


def setup_swap(engine: "LLMEngine", bytes_per_block: int) -> None:
    """Give the engine's scheduler a ``SwapManager`` and its runner a ``HostSwapSpace`` of ``swap_space`` GiB, unless
    ``preemption_mode`` is "recompute". ``auto`` compares the live roofline's prefill time of a victim's context with
    the transfer time at the host link's bandwidth (measured on CUDA, assumed on the CPU)."""
    c = engine.config
    if c.preemption_mode == "recompute":
        return
    num_host_blocks = int(c.swap_space * 2**30) // bytes_per_block
    cfg = engine.model_config
    # only auto's rule reads the bandwidth: the other modes do not pay for the measurement
    bandwidth = host_link_bandwidth(engine.device, measure=c.preemption_mode == "auto")
    roofline = engine.roofline
    engine.scheduler.swap = SwapManager(
        num_host_blocks, c.preemption_mode, bytes_per_block,
        recompute_seconds=lambda n: roofline.predict([n], [n], 1), bandwidth=bandwidth)
    engine.runner.swap_space = HostSwapSpace(num_host_blocks, c.block_size, cfg.num_key_value_heads, cfg.head_dim,
                                             cfg.num_hidden_layers, engine.dtype, c.kv_cache_dtype, engine.device)
