"""``--measure``: this machine's memory bandwidth and matmul peak, with torch (CUDA if available, else CPU). Quick:
well under a few seconds. Bandwidth: a large tensor copy (reads n bytes + writes n bytes); peak: a square matmul
(2·n³ OPs) in fp16 on CUDA, fp32 on CPU. The best of a few repetitions is kept (a roofline is an upper bound)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from rooflm.roofline.hardware import GB, GIB, Hardware

if TYPE_CHECKING:
    import torch


def _best_time(fn: Callable[[], None], device: str, reps: int) -> float:
    """Seconds of the fastest of ``reps`` runs of ``fn`` after one warm-up: CUDA events on a GPU (no host timing
    noise), ``perf_counter`` on the CPU."""
    import torch

    fn()  # warm-up
    if not device.startswith("cuda"):
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best
    torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def measure_bandwidth(device: str = "cpu", nbytes: int = 256 * 2**20, reps: int = 5) -> float:
    """Bytes/s of ``dst.copy_(src)`` on ``device``: 2·nbytes moved per copy (one read, one write)."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_time(lambda: dst.copy_(src), device, reps)


_KEYS = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def measure_matmul_peak(device: str = "cpu", n: int | None = None, reps: int = 3,
                        dtype: torch.dtype | None = None) -> tuple[str, float]:
    """(dtype key, OPs/s) of an n×n×n matmul: 2·n³ OPs. Default dtype: fp16 on CUDA, fp32 on the CPU."""
    import torch

    cuda = device.startswith("cuda")
    dtype = dtype or (torch.float16 if cuda else torch.float32)
    n = n or (8192 if cuda else 1024)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return _KEYS[str(dtype).removeprefix("torch.")], 2 * n**3 / _best_time(lambda: torch.mm(a, b), device, reps)


def measure_hardware() -> Hardware:
    """A ``Hardware`` from measurements of this machine (memory size: the device's, or the host's RAM)."""
    import os

    import torch

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    bw = measure_bandwidth(device, nbytes=(1024 if cuda else 256) * 2**20)
    key, peak = measure_matmul_peak(device)
    if cuda:
        mem = float(torch.cuda.get_device_properties(0).total_memory)
        name = f"measured {torch.cuda.get_device_name(0)}"
    else:
        try:
            mem = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError, AttributeError):
            mem = 16.0 * GIB
        name = f"measured CPU ({torch.get_num_threads()} threads)"
    return Hardware.from_measured(bw / GB, {key: peak / 1e12}, memory_gib=mem / GIB, name=name,
                                  source=f"measured with torch {torch.__version__} on {device}")
