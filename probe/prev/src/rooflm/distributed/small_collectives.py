"""A latency-first all-reduce for the small tensors of tensor-parallel decode steps.

Why. Under tensor parallelism (Megatron-LM, Shoeybi et al. 2019) every layer ends its attention and its MLP with an
all-reduce of the hidden states: at batch 1 of a 13B model that is 80 all-reduces of 10 KiB per step. A ring
all-reduce (NCCL's default) is built for bandwidth: 2 (N - 1) hops of chunks, each with its own synchronisation. At
10 KiB the bytes take nanoseconds over NVLink and the fixed costs dominate: NCCL takes 12 µs per all-reduce inside
a CUDA graph and 26-55 µs launched from Python (two H100s and two H200s), i.e. 1-4 ms per step, as much as the
whole step's weight reads save by splitting.

How. A *one-shot* all-reduce over peer-mapped memory (the scheme of NVIDIA's TensorRT-LLM and vLLM's custom
all-reduce): every rank owns a buffer that every other rank can address directly (PyTorch's symmetric memory,
``torch.distributed._symmetric_memory``, maps them once at start-up). One kernel per all-reduce
(``rooflm/kernels/one_shot_all_reduce.py``) copies the local input into the local buffer, meets the peers at a flag
handshake, reads every peer's buffer over NVLink and sums them in rank order, then meets them again so that no rank
overwrites its buffer while another still reads it. One launch, no host involvement: it is captured in CUDA graphs
like any kernel (8.4-8.7 µs at 8 KiB in a graph on two H100s). Every rank sums the same values in the same order, so
every rank holds the same result bit for bit (what the engine relies on: each rank samples from its own copy of the
logits).

Larger tensors (prefill of long prompts) keep NCCL: one shot reads ``(N - 1)`` whole inputs per rank, which is
slower than a ring once the bytes matter. The gather of the vocabulary-parallel LM head goes through the same path
as an all-reduce of zero-padded logits (each rank writes its vocabulary range into zeros; ``x + 0`` is exact), so a
decode step's graph holds no NCCL call at all.

Faster still for the 16-bit tensors of decode steps (up to 512 KiB): the *Lamport* variant
(``rooflm/kernels/lamport_all_reduce.py``, TensorRT-LLM's scheme), which marks empty slots with a sentinel value
instead of meeting the peers at flags: each rank pushes its input into every peer's buffer and waits only for the
peers' data to arrive, one crossing of the link instead of three (3.7 us at 10 KiB in a graph on two H100s). For a
few rows it also takes the residual add and RMSNorm that follow every all-reduce of a decoder layer into the same
launch (``all_reduce_rms_norm``). Larger or float32 tensors (the zero-padded logits) take the barrier kernel.

``ROOFLM_TP_ALLREDUCE`` chooses (see ``requested_mode``): ``nccl`` turns it off, ``triton`` keeps the barrier kernel
for everything, ``torch`` uses PyTorch's own one-shot kernel instead (13 µs; float32 and bfloat16 only). It is off
on the CPU (gloo), when PyTorch lacks symmetric memory, or when its set-up fails on any rank (logged; NCCL then
carries everything).
"""
from __future__ import annotations

import os
from typing import Any

import torch

from rooflm.logger import get_logger

logger = get_logger(__name__)

# Up to this many bytes per all-reduce go one-shot: decode hidden states (batch x hidden x 2 bytes: 320 KiB at batch
# 32 of a 5120-wide model) and gathered float32 logits up to ~64 rows of a 32k vocabulary.
DEFAULT_MAX_BYTES = 8 * 2**20
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # float16 is summed in float32 (see __call__)


_MODES = ("auto", "lamport", "triton", "torch", "nccl")
AUTO = "lamport"  # what ``auto`` picks
# Per-rank slot of the Lamport buffers: the largest 16-bit all-reduce they take (batch 32 of an 8192-wide model).
# Each rank's buffer holds three generations of one slot per rank: 3 x world x this.
LAMPORT_MAX_BYTES = 512 * 2**10
# Rows up to which the all-reduce, the residual add and RMSNorm run as one kernel (each program of the fused kernel
# reads its whole row, so its extra reads grow with the rows). Two H100s, Llama-2-13B's 5120-wide rows in CUDA
# graphs: one row 5.9 us fused against 5.8 us for the all-reduce and the norm kernel (a tie, also per decode step);
# 32 rows 9.6 against 8.6 us.
FUSED_NORM_MAX_ROWS = 4


# Symmetric-memory exchanges this process has started (``rendezvous_count``).
_RENDEZVOUS = 0


def rendezvous_count() -> int:
    """How many symmetric-memory rendezvous this process has started. PyTorch (before the fix of
    https://github.com/pytorch/pytorch/issues/196082) names the store keys of a rendezvous after the number of
    rendezvous the *process* has made, not the group: ranks whose counts differ (rank 0 of a second engine in one
    process beside freshly started workers) look for each other's keys under different names and wait forever.
    ``init_distributed`` compares the counts and uses NCCL where they differ."""
    return _RENDEZVOUS


def requested_mode() -> str:
    """``ROOFLM_TP_ALLREDUCE``: ``lamport`` (this project's kernels: the Lamport one for 16-bit tensors up to
    ``LAMPORT_MAX_BYTES``, the barrier one for the rest), ``triton`` (the barrier kernel,
    ``kernels/one_shot_all_reduce.py``, for everything), ``torch`` (PyTorch's ``symm_mem.one_shot_all_reduce_copy``;
    float16 summed in float32), ``nccl`` (off), or ``auto`` (the default: ``lamport``)."""
    mode = os.environ.get("ROOFLM_TP_ALLREDUCE", "auto").strip().lower()
    if mode not in _MODES:
        raise ValueError(f"ROOFLM_TP_ALLREDUCE={mode!r}: expected one of {', '.join(_MODES)}")
    return AUTO if mode == "auto" else mode


class OneShotAllReduce:
    """Sum of a small CUDA tensor over a process group in one kernel (see the module docstring).

    Build it with ``create`` on every rank of the group at the same point of start-up (the buffer exchange is a
    collective). ``eligible(x)`` tells whether ``x`` fits; ``__call__`` returns a new tensor with the sum."""

    def __init__(self, buffer: torch.Tensor, group_name: str, max_bytes: int, impl: str = "torch",
                 handle: Any = None) -> None:
        self.buffer = buffer  # uint8, symmetric: the same size at the same offset on every rank
        self.group_name = group_name
        self.max_bytes = max_bytes
        self.impl = impl
        self.calls = 0
        self.lamport = None  # LamportBuffers when impl is "lamport"
        # ROOFLM_TP_FUSED_NORM=0: the all-reduce and the norm after it as two kernels (for comparisons)
        self.fuse_norm = os.environ.get("ROOFLM_TP_FUSED_NORM", "1") != "0"
        if impl in ("triton", "lamport"):
            self.rank, self.world = handle.rank, handle.world_size
            self.buf_ptrs = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=buffer.device)
            self.pad_ptrs = torch.tensor(handle.signal_pad_ptrs, dtype=torch.int64, device=buffer.device)
            self.max_programs = max(1, min(256, handle.signal_pad_size // 4 // self.world))
        if impl == "lamport":  # the Lamport region follows the barrier kernel's max_bytes in every rank's buffer
            from rooflm.kernels.lamport_all_reduce import LamportBuffers

            ptrs = torch.tensor([p + max_bytes for p in handle.buffer_ptrs], dtype=torch.int64, device=buffer.device)
            state = torch.zeros(3, dtype=torch.int32, device=buffer.device)
            cap = LAMPORT_MAX_BYTES // 2
            mine = buffer[max_bytes:].view(torch.int16)[:LamportBuffers.elements(self.world, cap)]
            self.lamport = LamportBuffers(ptrs, state, self.rank, self.world, cap, mine)

    @classmethod
    def create(cls, group: Any, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES,
               token: str = "") -> "OneShotAllReduce | None":
        """The communicator for ``group`` on ``device``, or None where it cannot run (the caller then uses NCCL).
        ``token``: the same string on every rank and a new one for every process group (see ``symmetric_name``)."""
        mode = requested_mode()
        if device.type != "cuda" or mode == "nccl":
            return None
        try:
            import torch.distributed._symmetric_memory as symm_mem

            if mode == "torch" and not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):
                raise RuntimeError("this PyTorch has no symm_mem.one_shot_all_reduce_copy")
            name = symmetric_name(group, token) if token else group.group_name
            lamport_bytes = 0
            if mode == "lamport":
                from rooflm.kernels.lamport_all_reduce import SENTINEL, LamportBuffers

                lamport_bytes = 2 * LamportBuffers.elements(group.size(), LAMPORT_MAX_BYTES // 2)
            buffer = symm_mem.empty(max_bytes + lamport_bytes, dtype=torch.uint8, device=device)
            if lamport_bytes:
                buffer[max_bytes:].view(torch.int16).fill_(SENTINEL)  # every slot empty before any peer pushes
                torch.cuda.synchronize(device)
            global _RENDEZVOUS
            _RENDEZVOUS += 1  # counted when started: PyTorch's own count may have moved even if it fails
            handle = symm_mem.rendezvous(buffer, name)
        except Exception as e:  # noqa: BLE001 - any failure here only costs speed: NCCL carries the traffic
            logger.warning("one-shot all-reduce unavailable (%s: %s); tensor parallelism uses NCCL for every "
                           "all-reduce", type(e).__name__, e)
            return None
        logger.info("tensor-parallel all-reduces up to %d KiB go one-shot over peer memory (%s kernel)",
                    max_bytes // 1024, mode)
        return cls(buffer, name, max_bytes, mode, handle)

    def eligible(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.dtype in _DTYPES and x.is_contiguous() and x.numel() * 4 <= self.max_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.lamport is not None and self.lamport.fits(x):
            from rooflm.kernels.lamport_all_reduce import lamport_all_reduce

            return lamport_all_reduce(x, self.lamport)
        if self.impl in ("triton", "lamport"):
            from rooflm.kernels.one_shot_all_reduce import one_shot_all_reduce

            return one_shot_all_reduce(x, self.buf_ptrs, self.pad_ptrs, self.rank, self.world, self.max_programs)
        # PyTorch's one-shot kernel sums float32 and bfloat16; float16 is summed in float32 and rounded once. At two
        # ranks that equals NCCL's float16 sum bit for bit (the float32 sum of two float16 values is exact whenever
        # the rounding to float16 could depend on it); two conversion kernels, a few µs, ride along.
        x32 = x.float() if x.dtype == torch.float16 else x
        nbytes = x32.numel() * x32.element_size()
        staging = self.buffer[:nbytes].view(x32.dtype).view(x32.shape)
        out = torch.ops.symm_mem.one_shot_all_reduce_copy(staging, x32, "sum", self.group_name)
        return out.to(x.dtype) if out.dtype != x.dtype else out


    def all_reduce_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rms_norm(s) * weight, s) with s = the sum of ``x`` over the ranks + ``residual``, in one kernel; None
        where the Lamport kernel does not take ``x`` (the caller then reduces and normalises in two steps). The
        answer depends only on shapes and dtypes, so every rank takes the same path."""
        from rooflm.kernels.lamport_all_reduce import lamport_all_reduce_rms_norm, norm_fits

        if (self.lamport is None or not self.fuse_norm or x.dim() != 2 or x.shape[0] > FUSED_NORM_MAX_ROWS
                or not norm_fits(x, self.lamport) or residual.shape != x.shape or residual.dtype != x.dtype
                or not residual.is_contiguous() or weight.dtype != x.dtype):
            return None
        self.calls += 1
        return lamport_all_reduce_rms_norm(x, residual, weight, eps, self.lamport)


def symmetric_name(group: Any, token: str) -> str:
    """A name, new for this process group, under which PyTorch's symmetric memory meets the group's ranks.

    Symmetric memory remembers, for the life of the process, which store each group name exchanges its buffers
    through, while a process group made after ``destroy_process_group`` gets the name of the earlier one again (the
    names come from the ranks, or from a counter that the destruction resets). A second engine in the same process
    (the first shut down) would then look for its peers in the first group's store and wait forever, while its fresh
    workers wait in the new one. So each group is registered again under ``rooflm-<token>-<group name>``, with a
    token that rank 0 draws and every rank receives: as a process group of that name (PyTorch versions whose
    rendezvous resolves the group by name; ``destroy_process_group`` unregisters it) and, where PyTorch has it, with
    the store that name's buffers are exchanged through."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch._C._distributed_c10d import _SymmetricMemory

    name = f"rooflm-{token}-{group.group_name}"
    c10d._register_process_group(name, group)
    if hasattr(_SymmetricMemory, "set_group_info"):
        store = dist.PrefixStore(f"symmetric_memory-{name}", c10d._get_process_group_store(group))
        _SymmetricMemory.set_group_info(name, group.rank(), group.size(), store)
    return name


def gather_by_sum(x: torch.Tensor, sizes: list[int], rank: int, all_reduce) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension with one all-reduce: this rank's columns written into
    zeros at its offset (``sizes``: every rank's width), then summed over the ranks. Exact: each output element is
    one rank's value plus zeros."""
    start = sum(sizes[:rank])
    full = x.new_zeros(*x.shape[:-1], sum(sizes))
    full[..., start:start + x.shape[-1]] = x
    return all_reduce(full)
