# Row-wise argmax of the logits, for greedy decoding on the GPU: one program a row, one launch.
#
# Why a kernel of its own: at batch 1 a greedy step ends with the argmax of one row of the vocabulary (32,000 floats
# for Llama-2). torch's ``max(dim=-1)`` took 8.5 us on that row on an H200 (in a CUDA graph), about as long as a
# decode layer's o projection, for 128 KB that the LM head has just written and that still sit in the L2. One
# program of 32 warps reads the row in tiles of 16,384 values (16 a thread) and reduces each in registers and shared
# memory: 4.8 us (the fastest of 4-32 warps and 4,096-32,768 a tile; 6.6 against 11.9 us for a 49,152-wide row,
# 15.6 against 26.5 for 128,256, 5.1 against 9.1 at 32 rows).
#
# The result is torch's, index for index (``argmax_tokens`` in rooflm/layers/sampler.py and the tests hold it to
# that): the first index of the largest value; a NaN counts as larger than every number, so a row holding NaN gives
# its first NaN; a row of -inf gives 0. Each tile keeps its largest value and the first index of it, and the running
# choice moves to a later tile only on a strictly larger value, which keeps the first of equal maxima.
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rooflm.kernels._utils import next_pow2

__all__ = ["argmax_rows", "argmax_rows_ref"]

@triton.jit
def _argmax_kernel(x_ptr, out_ptr, V, stride_row, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride_row
    offs = tl.arange(0, BLOCK)
    best = float("-inf")
    best_idx = 0  # a row of -inf (or of nothing larger than the first value) keeps index 0
    nan_idx = 2147483647  # the first NaN's index; int32's largest (also "none" in the reductions below)
    for v0 in range(0, V, BLOCK):
        cols = v0 + offs
        mask = cols < V
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        isnan = x != x
        nan_idx = tl.minimum(nan_idx, tl.min(tl.where(isnan & mask, cols, 2147483647), 0))
        x = tl.where(isnan, float("-inf"), x)
        top = tl.max(x, 0)
        first = tl.min(tl.where((x == top) & mask, cols, 2147483647), 0)
        take = top > best  # strictly: an equal maximum in a later tile is not the first
        best_idx = tl.where(take, first, best_idx)
        best = tl.where(take, top, best)
    tl.store(out_ptr + row, tl.where(nan_idx < 2147483647, nan_idx, best_idx).to(tl.int64))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Indices [N] (int64) of the largest value of each row of ``logits`` [N, V] (float32, float16 or bfloat16, the
    last dimension contiguous), as ``logits.max(dim=-1).indices`` gives them (see the module header)."""
    if logits.dim() != 2 or logits.stride(-1) != 1 or logits.shape[1] == 0:
        raise ValueError(f"argmax_rows needs a non-empty [N, V] tensor with a contiguous last dimension; got shape "
                         f"{tuple(logits.shape)}, strides {logits.stride()}")
    n, v = logits.shape
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    # 16 values a thread (see the header): a 32,000-wide row is two tiles of 16,384 on 32 warps
    block = min(16384, next_pow2(v))
    _argmax_kernel[(n,)](logits, out, v, logits.stride(0), BLOCK=block, num_warps=max(1, min(32, block // 512)))
    return out


def argmax_rows_ref(logits: torch.Tensor) -> torch.Tensor:
    """The twin: torch's own."""
    return logits.max(dim=-1).indices
