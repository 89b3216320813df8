# Dynamic per-token quantization of activations to float8 e4m3, in one pass over each row.
#
# FP8 W8A8 linear layers (Micikevicius et al. 2022, "FP8 Formats for Deep Learning") quantize their input at run
# time, one scale per token: scale[m] = max|x[m, :]| / 448, x_fp8[m, :] = round(x[m, :] / scale[m]). Written as
# torch operators that is about seven elementwise kernels in float32 per projection (cast, abs, amax, divide, clamp,
# divide, clamp, cast), each a full read and most a full write of the [M, K] activation: at a 2048-token prefill of a
# 7B model they cost more than the fp8 tensor cores save (measured: 0.84x of float16 before this kernel). Here a
# program owns one row: it reads the row once into registers, reduces its absolute maximum, and writes the 1-byte
# codes and one float32 scale, the minimum of memory traffic (2 bytes read and 1 written per element at float16).
#
# The arithmetic is the reference's (``rooflm.quantization.fp8.quantize_fp8_per_token_reference``) step for step in float32 --
# IEEE division (Triton lowers ``/`` on float32 to a correctly rounded division), clamp to +-448, round to nearest even
# on the cast -- so codes and scales are bit-equal to it (a GPU test checks that).
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rooflm.kernels._utils import next_pow2

MAX_ROW = 65536  # one program holds a row in registers; wider rows are refused (no model here comes near)


@triton.jit
def _round_to_e4m3_grid(v):
    """float32 v with |v| <= 448 -> the nearest e4m3 value (ties to even), still as float32, so the cast that follows
    is exact. The hardware cast rounds the same way; doing it here keeps the result right where a cast rounds
    wrongly (Triton's CPU interpreter carries a mantissa round-up into the wrong exponent, e.g. 125.7 -> 64).
    Normal e4m3 values (|v| >= 2^-6) keep 3 of float32's 23 mantissa bits: add half an ulp of the kept part (less
    one, plus the lowest kept bit: ties to even) and clear the 20 low bits; a carry moves into the exponent as it
    should. Subnormals (|v| < 2^-6) sit on a fixed grid of 2^-9: adding and subtracting 1.5 * 2^14 rounds |v| to it,
    and v's sign bit goes back on (so -0.0 and small negatives keep their sign, as the cast keeps it)."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # -1048576 = ~0xFFFFF
    a = tl.abs(v)
    sub = (((a + 24576.0) - 24576.0).to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    return tl.where(a >= 0.015625, normal, sub)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q,
                       FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    scale = tl.maximum(amax / FP8_MAX, MIN_SCALE)
    q = _round_to_e4m3_grid(tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX))
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def quantize_rows_fp8(x: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float,
                      min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (float16, bfloat16 or float32, last dim contiguous) -> (codes [M, K] of ``fp8_dtype``, float32 scales
    [M, 1]). The contract of ``rooflm.quantization.fp8.quantize_fp8_per_token_reference``, in one kernel."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    if k > MAX_ROW:
        raise ValueError(f"x has rows of {k} elements; this kernel holds at most {MAX_ROW} in registers")
    q = torch.empty(m, k, dtype=fp8_dtype, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    block = next_pow2(max(k, 16))
    warps = 4 if block <= 2048 else (8 if block <= 8192 else 16)
    _quant_rows_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), FP8_MAX=fp8_max, MIN_SCALE=min_scale,
                             BLOCK=block, num_warps=warps)
    return q, s
