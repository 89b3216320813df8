"""One-shot all-reduce over peer-mapped (symmetric) memory, in Triton.

Every rank owns a buffer of the same size that every other rank can address (``torch.distributed._symmetric_memory``
maps them at start-up), plus a *signal pad* of 32-bit flags. One kernel does the whole all-reduce: program ``p`` copies
its chunks of the local input into the local buffer, meets program ``p`` of every peer at a barrier, sums every
rank's copy of those chunks (in rank order, in float32: every rank rounds the same sum once, so all ranks hold the
same result), and meets them again, so no rank writes its buffer while a peer still reads it. This is the scheme of
the custom all-reduce of TensorRT-LLM and vLLM (one launch, no host work, captured in CUDA graphs like any kernel),
here for float16 too, which PyTorch's own one-shot kernel does not take.

The barrier between program ``p`` of rank ``r`` and of rank ``q`` is a handshake on two flags: ``r`` sets slot
``(p, r)`` in ``q``'s pad from 0 to 1 (a release at system scope: it publishes the block's earlier stores, which the
preceding ``debug_barrier`` ordered before it), and waits until slot ``(p, q)`` of its own pad is 1, setting it back
to 0 (an acquire). A flag is back at 0 after every barrier, so the pads need no reset between calls or graph
replays; a second barrier on the same slots waits until the peer consumed the first. Thread ``q`` of the program
talks to peer ``q``; the others wait at the block barrier.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Thread q: set our flag in peer q's pad (0 -> 1, release), then wait for peer q's flag in ours (1 -> 0, acquire).
_HANDSHAKE_PTX = tl.constexpr("""
{
    .reg .u32 %old;
    .reg .pred %done;
SEND:
    atom.release.sys.global.cas.b32 %old, [$1], 0, 1;
    setp.eq.u32 %done, %old, 0;
    @!%done bra SEND;
WAIT:
    atom.acquire.sys.global.cas.b32 %old, [$2], 1, 0;
    setp.eq.u32 %done, %old, 1;
    @!%done bra WAIT;
    mov.u32 $0, %old;
}
""")


@triton.jit
def _thread_id():
    return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _barrier(pad_ptrs, slot, RANK: tl.constexpr, WORLD: tl.constexpr):
    peers = tl.arange(0, WORLD)
    pads = pad_ptrs.to(tl.pointer_type(tl.int64))
    theirs = tl.load(pads + peers).to(tl.pointer_type(tl.int32)) + slot * WORLD + RANK
    ours = tl.load(pads + RANK).to(tl.pointer_type(tl.int32)) + slot * WORLD + peers
    tl.debug_barrier()  # every thread's earlier stores happen before the release below
    if _thread_id() < WORLD:
        tl.inline_asm_elementwise(_HANDSHAKE_PTX, "=r,l,l", [theirs, ours], dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()  # and every thread's later loads after the acquire


@triton.jit
def _one_shot_kernel(x_ptr, out_ptr, buf_ptrs, pad_ptrs, n, RANK: tl.constexpr, WORLD: tl.constexpr,
                     BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    bufs = buf_ptrs.to(tl.pointer_type(tl.int64))
    mine = tl.multiple_of(tl.load(bufs + RANK).to(tl.pointer_type(x_ptr.dtype.element_ty)), 16)
    for start in range(pid * BLOCK, n, step):
        offs = tl.multiple_of(start, BLOCK) + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(mine + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
    _barrier(pad_ptrs, pid, RANK, WORLD)
    for start in range(pid * BLOCK, n, step):
        offs = tl.multiple_of(start, BLOCK) + tl.arange(0, BLOCK)
        mask = offs < n
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for q in tl.static_range(WORLD):
            peer = tl.multiple_of(tl.load(bufs + q).to(tl.pointer_type(x_ptr.dtype.element_ty)), 16)
            acc += tl.load(peer + offs, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    _barrier(pad_ptrs, pid, RANK, WORLD)


def one_shot_all_reduce(x: torch.Tensor, buf_ptrs: torch.Tensor, pad_ptrs: torch.Tensor, rank: int, world: int,
                        max_programs: int) -> torch.Tensor:
    """The sum of ``x`` over the ranks (a new tensor). ``buf_ptrs`` / ``pad_ptrs``: int64 device tensors of every
    rank's buffer and signal-pad address; ``max_programs``: the pad's slots per peer (programs meet by index)."""
    out = torch.empty_like(x)
    n = x.numel()
    block = 1024 if n >= 1024 else max(triton.next_power_of_2(n), 128)
    grid = (min(triton.cdiv(n, block), max_programs),)
    _one_shot_kernel[grid](x, out, buf_ptrs, pad_ptrs, n, RANK=rank, WORLD=world, BLOCK=block, num_warps=4)
    return out
