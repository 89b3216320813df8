# A decode step's inputs into the static buffers of its CUDA graph, in one launch.
#
# A captured graph reads its inputs from fixed buffers (rooflm/worker/cuda_graphs.py), so each replay is preceded by
# copies of the step's token ids, positions, cache slots, context lengths and block table into them, and by the
# padding of the bucket's unused rows (no cache write, no context). As five copies and two fills these are seven
# small operations a step; on an H200 each device-to-device copy of a batch-1 step took 0.8 us and the next began
# about 2 us after the one before (a profile of `rooflm bench latency`), so together about 10 us of a 3.75 ms step
# of a 7B model. One program per row of the bucket does all of it: its tokens, its context length and its block
# table row, or the padding.
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rooflm.kernels._utils import next_pow2

__all__ = ["launch_stage", "misfit", "stage_inputs", "stage_inputs_ref"]


@triton.jit
def _stage_kernel(ids_src, pos_src, slot_src, lens_src, tbl_src, ids_dst, pos_dst, slot_dst, lens_dst, tbl_dst,
                  n, width, pad_len, stride_src, stride_dst, Q: tl.constexpr, BLOCK_Q: tl.constexpr,
                  BLOCK_W: tl.constexpr):
    row = tl.program_id(0)
    offs_q = row * Q + tl.arange(0, BLOCK_Q)
    mask_q = tl.arange(0, BLOCK_Q) < Q
    if row < n:
        tl.store(ids_dst + offs_q, tl.load(ids_src + offs_q, mask=mask_q), mask=mask_q)
        tl.store(pos_dst + offs_q, tl.load(pos_src + offs_q, mask=mask_q), mask=mask_q)
        tl.store(slot_dst + offs_q, tl.load(slot_src + offs_q, mask=mask_q), mask=mask_q)
        tl.store(lens_dst + row, tl.load(lens_src + row))
        src = tbl_src + row.to(tl.int64) * stride_src
        dst = tbl_dst + row.to(tl.int64) * stride_dst
        for w0 in range(0, width, BLOCK_W):
            offs_w = w0 + tl.arange(0, BLOCK_W)
            mask_w = offs_w < width
            tl.store(dst + offs_w, tl.load(src + offs_w, mask=mask_w), mask=mask_w)
    else:  # a padding row of the bucket: no cache write, and pad_len (0 at decode) positions of context
        tl.store(slot_dst + offs_q, tl.full([BLOCK_Q], -1, tl.int64), mask=mask_q)
        tl.store(lens_dst + row, pad_len)


def misfit(src: tuple[torch.Tensor, ...], dst: tuple[torch.Tensor, ...], n: int, q: int, bs: int) -> str | None:
    """Why ``stage_inputs`` cannot take these tensors (a message naming the input), or None when it can."""
    names = ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables")
    for name, s, d in zip(names, src, dst):
        if s.dtype != d.dtype or s.device != d.device:
            return f"{name}: a {s.dtype} tensor on {s.device} for a {d.dtype} buffer on {d.device}"
    for name, s, d, rows, room in zip(names[:4], src, dst, (n * q,) * 3 + (n,), (bs * q,) * 3 + (bs,)):
        if s.dim() != 1 or s.shape[0] != rows or not s.is_contiguous() or not d.is_contiguous():
            return f"{name}: expected {rows} contiguous entries, got shape {tuple(s.shape)}"
        if d.shape[0] < room:
            return f"{name}: the buffer of {d.shape[0]} entries is smaller than the bucket ({bs} x {q})"
    t, b = src[4], dst[4]
    if t.dim() != 2 or t.shape[0] != n or t.shape[1] > b.shape[1] or b.shape[0] < bs or t.stride(1) != 1 \
            or b.stride(1) != 1:
        return f"block_tables: {tuple(t.shape)} (strides {t.stride()}) does not fit the buffer {tuple(b.shape)}"
    return None


def stage_inputs(src: tuple[torch.Tensor, ...], dst: tuple[torch.Tensor, ...], n: int, q: int, bs: int,
                 pad_len: int) -> None:
    """Write a step's inputs ``src`` = (input_ids [n q], positions [n q], slot_mapping [n q], seq_lens [n],
    block_tables [n, w]) into the first rows of the static buffers ``dst`` (the same five, [>= bs q] / [>= bs] /
    [>= bs, >= w]), and pad rows n .. bs - 1 of the bucket: slot -1 (no cache write) and context length ``pad_len``.
    Token ids and positions of padding rows and table entries past w are left as they were (nothing reads them).
    The same writes as ``stage_inputs_ref``."""
    why = misfit(src, dst, n, q, bs)
    if why is not None:
        raise ValueError(f"stage_inputs: {why}")
    launch_stage(src, dst, n, q, bs, pad_len)


def launch_stage(src: tuple[torch.Tensor, ...], dst: tuple[torch.Tensor, ...], n: int, q: int, bs: int,
                 pad_len: int) -> None:
    """``stage_inputs`` without its checks, for a caller that has asked ``misfit`` already (once a step)."""
    w = src[4].shape[1]
    _stage_kernel[(bs,)](*src, *dst, n, w, pad_len, src[4].stride(0), dst[4].stride(0), Q=q,
                         BLOCK_Q=next_pow2(q), BLOCK_W=min(1024, next_pow2(max(w, 1))), num_warps=1)


def stage_inputs_ref(src: tuple[torch.Tensor, ...], dst: tuple[torch.Tensor, ...], n: int, q: int, bs: int,
                     pad_len: int) -> None:
    """The twin: torch copies and fills."""
    t, w = n * q, src[4].shape[1]
    for s, d in zip(src[:3], dst[:3]):
        d[:t].copy_(s)
    dst[3][:n].copy_(src[3])
    dst[4][:n, :w].copy_(src[4])
    dst[2][t: bs * q].fill_(-1)
    dst[3][n:bs].fill_(pad_len)
