"""Small helpers shared by the kernel modules (no kernels here)."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rooflm.quantization.packed import PackedWeight


# Where a kernel lets the next one be scheduled under programmatic dependent launch (rooflm/kernels/_tl.py). The
# next kernel's programs then take places on the multiprocessors and wait there: early, they share the issue slots
# and memory of this kernel's remaining programs; late, only their drain. rooflm/kernels/handoff_gemv.py says which
# boundary of a decode layer takes which.
TRIGGER_START = 1  # at each program's start
TRIGGER_LATE = 2  # after each program's main loop


@dataclass(frozen=True)
class HandoffLaunch:
    """How a handed-over pair of one-row projections (rooflm/kernels/handoff_gemv.py) is launched under programmatic
    dependent launch: both wait in place for the kernel before them, each lets the next kernel in at its trigger
    and may load its first weight tile before it waits. The model launches the pair so, and ``pick_handoff`` times
    the pair's tiles so."""
    producer_trigger: int
    producer_preload: bool
    consumer_trigger: int
    consumer_preload: bool

    def producer(self) -> dict:
        return {"pdl_wait": True, "pdl_trigger": self.producer_trigger, "pdl_preload": self.producer_preload}

    def consumer(self) -> dict:
        return {"pdl_wait": True, "pdl_trigger": self.consumer_trigger, "pdl_preload": self.consumer_preload}


# o_proj (resident while decode attention runs: its first tile loaded before it waits) -> gate_up_proj, and
# down_proj -> the next layer's qkv_proj (which lets decode attention in at its start).
O_TO_GATE_UP = HandoffLaunch(TRIGGER_START, True, TRIGGER_LATE, True)
DOWN_TO_QKV = HandoffLaunch(TRIGGER_LATE, False, TRIGGER_START, True)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int = 0) -> int:
    if not torch.cuda.is_available():
        return 8  # the interpreter: small grids keep CPU tests fast
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(t: torch.Tensor) -> int:
    return num_sms(t.device.index or 0) if t.is_cuda else num_sms(0)


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension; its strides are {tuple(t.stride())}")


def time_in_graph(call, weights: list[torch.Tensor], device: torch.device, reps: int = 3) -> float:
    """Median milliseconds of one ``call(w)``, replayed from a CUDA graph that cycles through ``weights`` (copies of
    one matrix, together several times the L2): each call streams its weight from device memory, as in a real
    decode step where the other layers' weights evict it, and no launch overhead is counted."""
    for w in weights:
        call(w)  # compile / autotune outside the capture
    torch.cuda.synchronize(device)
    rounds = max(1, 24 // len(weights))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for w in weights:
                call(w)
    graph.replay()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (rounds * len(weights)))
    del graph
    times.sort()
    return times[len(times) // 2]


def check_tiles(cfg, names: tuple[str, ...]) -> None:
    """ValueError naming the field unless each of ``names`` of the kernel configuration ``cfg`` is a power of two
    and its ``split_k`` at least 1."""
    for name in names:
        v = getattr(cfg, name)
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name}={v} must be a power of two")
    if cfg.split_k < 1:
        raise ValueError(f"split_k={cfg.split_k} must be >= 1")


def _copy_count(nbytes: int, device: torch.device, min_bytes: int | None = None) -> int:
    """How many copies of an ``nbytes`` matrix hold together ``min_bytes`` (default: about three L2s of
    ``device``): at least two, at most eight."""
    if min_bytes is None:
        l2 = 64 * 2**20
        if device.type == "cuda":
            l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or l2)
        min_bytes = 3 * l2
    return max(2, min(8, -(-min_bytes // nbytes)))


def weight_copies(weight: torch.Tensor, min_bytes: int | None = None) -> list[torch.Tensor]:
    """``weight`` plus copies enough to hold together about three L2s (at least two matrices, at most eight)."""
    n = _copy_count(weight.numel() * weight.element_size(), weight.device, min_bytes)
    return [weight] + [weight.clone() for _ in range(n - 1)]


def packed_copies(pw: PackedWeight) -> list[PackedWeight]:
    """``pw`` plus copies enough to hold together about three L2s (at least two, at most eight), for timings in
    which each call streams its weight from device memory."""
    from rooflm.quantization.packed import PackedWeight

    n = _copy_count(pw.nbytes, pw.qweight.device)
    return [pw] + [PackedWeight(pw.qweight.clone(), pw.scales.clone(), None if pw.mins is None else pw.mins.clone(),
                                pw.bits, pw.group_size, mma=None if pw.mma is None else pw.mma.clone())
                   for _ in range(n - 1)]
