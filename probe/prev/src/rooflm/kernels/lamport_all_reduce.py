"""All-reduce of small 16-bit tensors without barriers (Lamport-style flags in the data), optionally fused with the
residual add and RMSNorm that follow it in a tensor-parallel decoder layer.

Why. The barrier one-shot kernel (``one_shot_all_reduce.py``) pays three crossings of the link per call: a flag
handshake, remote reads of every peer's buffer, and a second handshake so no rank overwrites a buffer a peer still
reads. At the 10 KiB of a batch-1 decode step those crossings, not the bytes, are the cost (8.7 us in a CUDA graph
on two H100s).

How. The scheme of TensorRT-LLM's "Lamport" all-reduce kernels (after Lamport's observation that a reader can tell a
fresh value from an old one when an impossible value marks the empty slots): every rank's peer-mapped buffer holds
three *generations* of ``WORLD`` slots, one slot per sending rank, kept filled with a sentinel, the bit pattern of
-0.0 (0x8000 in float16 and bfloat16). A call
  1. pushes: stores its input into slot ``RANK`` of the current generation of every rank's buffer (its own
     included), with -0.0 written as +0.0 so no real value equals the sentinel (a sum's sign of zero is all this can
     change);
  2. reduces: polls its own buffer's slots with volatile loads until no element is the sentinel, then adds the
     ``WORLD`` slots in rank order in float32 and rounds once: every rank computes the same sum bit for bit;
  3. clears the previous generation of its own buffer back to the sentinel.
One crossing of the link (the peers' stores), no flags and no second meeting: a rank writes into a peer's
generation ``g`` only in call ``g`` and clears its own generation ``g`` only in call ``g + 1`` (as "the one before
``g + 2``"), and a peer cannot reach call ``g + 3`` (the next writes into ``g``) before this rank's pushes of call
``g + 1`` and ``g + 2``, which come after that clear in stream order. The generation and the size of the previous
call live on the device (``state``: generation, previous size, arrival count): the last program of a call to finish
moves them on, so the kernel captures into CUDA graphs like any other and replays stay in step.

Fused epilogue (``NORM``): the programs of a row each push one chunk of it, but wait for and read the whole row
(from their own buffer, one wide load per rank: each round trip of a polling loop costs a memory latency, so a
program never polls chunk after chunk) to take RMSNorm's statistic (Zhang & Sennrich 2019, with the roundings of
``rooflm/kernels/rmsnorm.py``), then write their chunk of the new residual stream and of the normalised row: the
decoder layer's all-reduce, add and norm are one launch instead of two, and the remote stores stay spread over
several programs.

A program waits only for data that the same program of every peer pushes before it waits, so the kernel cannot
deadlock as long as every program of a call is resident at once: callers launch at most ``MAX_PROGRAMS``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SENTINEL = -32768  # int16 bits of -0.0 in float16 and bfloat16
_SENTINEL = tl.constexpr(SENTINEL)  # the same, for the kernels
MAX_PROGRAMS = 64  # of the plain all-reduce (a loop covers larger tensors); resident at once on any GPU
MAX_NORM_PROGRAMS = 512  # of the fused norm (one per 1024-element chunk of each row); 4-warp programs, resident too
BLOCK = 1024  # elements a program pushes at a time
DTYPES = (torch.float16, torch.bfloat16)


@triton.jit
def _peer(mine, buf_ptrs, q: tl.constexpr, RANK: tl.constexpr):
    """Rank q's buffer, as this rank's buffer ``mine`` (a pointer argument) plus the distance between the two: Triton
    knows an argument's 16-byte alignment and the offset's divisibility, so the accesses through it compile to
    16-byte vector accesses; through the address converted to a pointer every access would be a 2-byte one."""
    if q == RANK:
        p = mine
    else:
        table = buf_ptrs.to(tl.pointer_type(tl.int64))
        p = mine + tl.multiple_of((tl.load(table + q) - tl.load(table + RANK)) // 2, 8)
    return p


@triton.jit
def _push(x_bits_ptr, mine, buf_ptrs, offs, mask, slot_base, RANK: tl.constexpr, WORLD: tl.constexpr):
    bits = tl.load(x_bits_ptr + offs, mask=mask, other=0)
    bits = tl.where(bits == _SENTINEL, 0, bits)  # -0.0 -> +0.0: no real value may equal the sentinel
    for q in tl.static_range(WORLD):
        tl.store(_peer(mine, buf_ptrs, q, RANK) + slot_base + offs, bits, mask=mask)


@triton.jit
def _gather_sum(mine, gen_base, cap, offs, mask, out_ptr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """Every rank's slot at ``offs`` of this generation, waited for, summed in rank order in float32 (``out_ptr``
    gives the 16-bit float type the slots hold)."""
    acc = tl.zeros([BLOCK], tl.float32)
    for q in tl.static_range(WORLD):
        src = mine + gen_base + q * cap + offs
        v = tl.load(src, mask=mask, other=0, volatile=True)
        while tl.max(((v == _SENTINEL) & mask).to(tl.int32), 0) > 0:
            v = tl.load(src, mask=mask, other=0, volatile=True)
        acc += v.to(out_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
    return acc


@triton.jit
def _lamport_kernel(x_ptr, out_ptr, res_ptr, res_out_ptr, nw_ptr, eps, mine, buf_ptrs, state_ptr, n, H, cap,
                    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr,
                    HAS_RES: tl.constexpr, PUSH: tl.constexpr, REDUCE: tl.constexpr, ROW_BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    gen = tl.load(state_ptr)
    gen_base = gen * WORLD * cap
    x_bits = x_ptr.to(tl.pointer_type(tl.int16))
    if NORM:  # program pid: chunk pid % parts of row pid // parts of [M, H]
        parts = tl.cdiv(H, BLOCK)
        row, part = pid // parts, pid % parts
        cols = part * BLOCK + tl.arange(0, BLOCK)
        c = tl.arange(0, ROW_BLOCK)
        rmask = c < H
        mine_cols = rmask & (c // BLOCK == part)
        if REDUCE:
            # what does not depend on the peers is loaded before the wait, so its latency hides behind the link's
            # (loaded after it, the residual and the norm weight added two memory round trips to every call)
            if HAS_RES:
                r = tl.load(res_ptr + row * H + c, mask=rmask, other=0.0)
            w = tl.load(nw_ptr + c, mask=mine_cols, other=0.0)
        if PUSH:
            _push(x_bits, mine, buf_ptrs, row * H + cols, cols < H, gen_base + RANK * cap, RANK, WORLD)
        if REDUCE:
            # the norm's statistic needs the whole row: every program of the row waits for all of it, one wide load
            # per rank from its own buffer (the link is crossed once per element, by the push), normalises it and
            # writes its own chunk
            dt = out_ptr.dtype.element_ty
            s = _gather_sum(mine, gen_base, cap, row * H + c, rmask, out_ptr, WORLD, ROW_BLOCK).to(dt)
            if HAS_RES:  # the sum rounded to the dtype, plus the residual rounded again (0 where masked)
                s = (s.to(tl.float32) + r.to(tl.float32)).to(dt)
            s = s.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(s * s, 0) / H + eps)
            tl.store(res_out_ptr + row * H + c, s.to(dt), mask=mine_cols)
            y = (s * rstd).to(dt)
            tl.store(out_ptr + row * H + c, (w.to(tl.float32) * y.to(tl.float32)).to(dt), mask=mine_cols)
    else:  # programs stride over BLOCK-element chunks of the flat tensor
        if PUSH:
            for start in range(pid * BLOCK, n, nprog * BLOCK):
                offs = tl.multiple_of(start, BLOCK) + tl.arange(0, BLOCK)  # whole 16-byte vectors
                _push(x_bits, mine, buf_ptrs, offs, offs < n, gen_base + RANK * cap, RANK, WORLD)
        if REDUCE:
            for start in range(pid * BLOCK, n, nprog * BLOCK):
                offs = tl.multiple_of(start, BLOCK) + tl.arange(0, BLOCK)  # whole 16-byte vectors
                mask = offs < n
                acc = _gather_sum(mine, gen_base, cap, offs, mask, out_ptr, WORLD, BLOCK)
                tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    if REDUCE:
        # back to the sentinel: the previous call's generation of this rank's buffer (every slot, its size)
        prev_n = tl.load(state_ptr + 1)
        prev_base = ((gen + 2) % 3) * WORLD * cap
        for start in range(pid * BLOCK, prev_n, nprog * BLOCK):
            offs = tl.multiple_of(start, BLOCK) + tl.arange(0, BLOCK)
            for q in tl.static_range(WORLD):
                tl.store(mine + prev_base + q * cap + offs, tl.full([BLOCK], _SENTINEL, tl.int16), mask=offs < prev_n)
        # the last program to finish moves the generation on (every program read it above)
        arrived = tl.atomic_add(state_ptr + 2, 1)
        if arrived == nprog - 1:
            tl.store(state_ptr + 2, 0)
            tl.store(state_ptr + 1, n)
            tl.store(state_ptr, (gen + 1) % 3)


class LamportBuffers:
    """This rank's view of the peer-mapped buffers: ``buf_ptrs`` (int64 device tensor: every rank's buffer address,
    each 3 x world x ``cap`` int16 elements, filled with ``SENTINEL`` before first use), ``mine`` (this rank's
    buffer, the one at ``buf_ptrs[rank]``, as a 16-byte aligned int16 tensor) and ``state`` (int32 [3] on this
    rank's device, zeros: generation, previous size, arrivals)."""

    def __init__(self, buf_ptrs: torch.Tensor, state: torch.Tensor, rank: int, world: int, cap: int,
                 mine: torch.Tensor) -> None:
        if mine.dtype != torch.int16 or mine.numel() < self.elements(world, cap) or mine.data_ptr() % 16:
            raise ValueError(f"mine must be this rank's buffer: a 16-byte aligned int16 tensor of at least "
                             f"{self.elements(world, cap)} elements; got {mine.dtype}, {mine.numel()} elements")
        self.buf_ptrs, self.state, self.rank, self.world, self.cap = buf_ptrs, state, rank, world, cap
        self.mine = mine

    @staticmethod
    def elements(world: int, cap: int) -> int:
        """Size of each rank's buffer in int16 elements."""
        return 3 * world * cap

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype in DTYPES and x.is_contiguous() and 0 < x.numel() <= self.cap


def _launch(x, out, res, res_out, nw, eps, bufs: LamportBuffers, norm: bool, grid: int, push: bool,
            reduce: bool) -> None:
    H = x.shape[-1] if norm else 1
    _lamport_kernel[(grid,)](x, out, res, res_out, nw, float(eps), bufs.mine, bufs.buf_ptrs, bufs.state, x.numel(), H,
                             bufs.cap, RANK=bufs.rank, WORLD=bufs.world, BLOCK=BLOCK, NORM=norm,
                             HAS_RES=res is not x, PUSH=push, REDUCE=reduce,
                             ROW_BLOCK=triton.next_power_of_2(H) if norm else 1,
                             num_warps=8 if norm else 4)  # 8: the whole row per program (4: 6.7 us, 8: 5.5, 16: 5.6)


def lamport_all_reduce(x: torch.Tensor, bufs: LamportBuffers, out: torch.Tensor | None = None,
                       push: bool = True, reduce: bool = True) -> torch.Tensor:
    """The sum of ``x`` (float16 or bfloat16, at most ``bufs.cap`` elements) over the ranks, in a new tensor (or
    ``out``). ``push`` / ``reduce`` run one half of the call (tests that play every rank in one process push for all
    ranks first); a call that reduces is one generation."""
    if not bufs.fits(x):
        raise ValueError(f"x ({x.dtype}, {x.numel()} elements) does not fit the Lamport all-reduce: float16 or "
                         f"bfloat16, contiguous, 1 to {bufs.cap} elements")
    out = torch.empty_like(x) if out is None else out
    grid = min(triton.cdiv(x.numel(), BLOCK), MAX_PROGRAMS)
    _launch(x, out, x, x, x, 0.0, bufs, False, grid, push, reduce)
    return out


def norm_fits(x: torch.Tensor, bufs: LamportBuffers) -> bool:
    """Whether ``lamport_all_reduce_rms_norm`` takes rows like ``x``."""
    return x.dim() == 2 and bufs.fits(x) and x.shape[0] * triton.cdiv(x.shape[1], BLOCK) <= MAX_NORM_PROGRAMS


def lamport_all_reduce_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                                bufs: LamportBuffers, push: bool = True,
                                reduce: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s) * norm_weight, s) with s = sum of ``x`` over the ranks (+ ``residual``), one launch. x, residual:
    [M, H], M x ceil(H / 1024) <= ``MAX_NORM_PROGRAMS``."""
    if not norm_fits(x, bufs):
        raise ValueError(f"x {tuple(x.shape)} ({x.dtype}) does not fit the fused all-reduce + RMSNorm: [rows, hidden] "
                         f"with rows x ceil(hidden / {BLOCK}) <= {MAX_NORM_PROGRAMS}, float16 or bfloat16, "
                         f"contiguous, at most {bufs.cap} elements")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or
                                 not residual.is_contiguous()):
        raise ValueError(f"residual {tuple(residual.shape)} ({residual.dtype}) does not match x {tuple(x.shape)} "
                         f"({x.dtype})")
    if norm_weight.shape != (x.shape[1],):
        raise ValueError(f"norm_weight {tuple(norm_weight.shape)} does not match hidden size {x.shape[1]}")
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    _launch(x, out, residual if residual is not None else x, res_out, norm_weight.contiguous(), eps, bufs, True,
            x.shape[0] * triton.cdiv(x.shape[1], BLOCK), push, reduce)
    return out, res_out
