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
# The arithmetic is the reference's (``rooflm.quantization.fp8.quantize_fp8_per_token_reference``) step for step in
# float32 -- IEEE division (Triton lowers ``/`` on float32 to a correctly rounded division), clamp to +-448, round to
# nearest even on the cast -- so codes and scales are bit-equal to it (a GPU test checks that).
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rooflm.kernels._utils import check_last_dim_contiguous, interpreting, next_pow2
from rooflm.kernels.activation import silu_mul_row
from rooflm.kernels.rmsnorm import add_rmsnorm_row
from rooflm.quantization.fp8 import QUANT_KERNEL_MAX_ROW

MAX_ROW = QUANT_KERNEL_MAX_ROW  # one program holds a row in registers; wider rows are refused (no model comes near)


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
def _quantize_row(v, q_ptr, s_ptr, row, stride_q, offs, mask, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                  SOFT_ROUND: tl.constexpr):
    """Codes and scale of one float32 row ``v`` (masked lanes 0), written to row ``row`` of q and s. SOFT_ROUND:
    round to the e4m3 grid before the cast (the interpreter); a GPU's cast instruction rounds to nearest even
    itself, and skipping the ~15 integer operations per element keeps the kernels at memory speed."""
    amax = tl.max(tl.abs(v), axis=0)
    scale = tl.maximum(amax / FP8_MAX, MIN_SCALE)
    q = tl.minimum(tl.maximum(v / scale, -FP8_MAX), FP8_MAX)
    if SOFT_ROUND:
        q = _round_to_e4m3_grid(q)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


# The same quantization as the last step of the two operators that produce a projection's input in a Llama block,
# so that the float16 row they would write (and the quantization kernel would read back) never leaves registers: the
# add + RMSNorm before qkv and gate_up (the roundings of ``rooflm/kernels/rmsnorm.py``), and SiLU-and-mul before
# down (``rooflm/kernels/activation.py``). The row is rounded to the activation dtype first, exactly where the
# separate operator rounds its output, so codes and scales are bit-equal to running the two kernels in turn.
OP_NONE, OP_RMSNORM, OP_SILU_MUL = 0, 1, 2


@triton.jit
def _quant_rows_kernel(x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, res_out_ptr, stride_x, stride_r, stride_q, stride_ro, K,
                       eps, OP: tl.constexpr, HAS_RESIDUAL: tl.constexpr, FP8_MAX: tl.constexpr,
                       MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """One program per row: the row's values by OP, then their codes and scale. OP 0: x as it is (K columns);
    OP_RMSNORM: the (add +) RMSNorm of x; OP_SILU_MUL: silu(gate) * up of x = [gate | up] (K = d columns out)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    if OP == 1:  # OP_RMSNORM (Triton reads no module-level ints inside a kernel)
        v = add_rmsnorm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, stride_x, stride_r, stride_ro, offs, mask, K,
                            eps, HAS_RESIDUAL)
    elif OP == 2:  # OP_SILU_MUL
        v = silu_mul_row(x_ptr, row, stride_x, offs, mask, K)
    else:
        v = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    _quantize_row(v.to(tl.float32), q_ptr, s_ptr, row, stride_q, offs, mask, FP8_MAX, MIN_SCALE, SOFT_ROUND)


def _launch(op: int, x: torch.Tensor, k: int, fp8_dtype: torch.dtype, fp8_max: float, min_scale: float,
            residual: torch.Tensor | None = None, weight: torch.Tensor | None = None, eps: float = 0.0,
            res_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    m = x.shape[0]
    block, warps = _row_launch(k)
    q, s = _codes(m, k, fp8_dtype, x.device)
    r = residual if residual is not None else x
    ro = res_out if res_out is not None else x
    if m:
        _quant_rows_kernel[(m,)](x, r, weight if weight is not None else x, q, s, ro, x.stride(0), r.stride(0),
                                 q.stride(0), ro.stride(0), k, float(eps), OP=op, HAS_RESIDUAL=residual is not None,
                                 FP8_MAX=fp8_max, MIN_SCALE=min_scale, BLOCK=block, SOFT_ROUND=interpreting(),
                                 num_warps=warps)
    return q, s


def _row_launch(k: int) -> tuple[int, int]:
    """Block and warps of a one-row-per-program kernel over rows of k elements."""
    if k > MAX_ROW:
        raise ValueError(f"rows of {k} elements; these kernels hold at most {MAX_ROW} in registers")
    block = next_pow2(max(k, 16))
    return block, 4 if block <= 2048 else (8 if block <= 8192 else 16)


def _codes(m: int, k: int, fp8_dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(m, k, dtype=fp8_dtype, device=device),
            torch.empty(m, 1, dtype=torch.float32, device=device))


def quantize_rows_fp8(x: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float,
                      min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (float16, bfloat16 or float32, last dim contiguous) -> (codes [M, K] of ``fp8_dtype``, float32 scales
    [M, 1]). The contract of ``rooflm.quantization.fp8.quantize_fp8_per_token_reference``, in one kernel."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    return _launch(OP_NONE, x, x.shape[1], fp8_dtype, fp8_max, min_scale)


def rms_norm_quantize_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, fp8_dtype: torch.dtype,
    fp8_max: float, min_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_rows_fp8(rms_norm(x [+ residual]))`` in one kernel: x, residual [M, K] (last dim contiguous) ->
    (codes [M, K], float32 scales [M, 1], the residual stream x + residual, or x itself without residual)."""
    if x.dim() != 2 or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"x must be 2-D [M, K] and residual the same shape, got {tuple(x.shape)} and "
                         f"{None if residual is None else tuple(residual.shape)}")
    check_last_dim_contiguous("x", x)
    if residual is None:
        return (*_launch(OP_RMSNORM, x, x.shape[1], fp8_dtype, fp8_max, min_scale, weight=weight, eps=eps), x)
    check_last_dim_contiguous("residual", residual)
    res_out = torch.empty_like(x)
    q, s = _launch(OP_RMSNORM, x, x.shape[1], fp8_dtype, fp8_max, min_scale, residual, weight, eps, res_out)
    return q, s, res_out


def silu_and_mul_quantize_fp8(x: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float,
                              min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows_fp8(silu_and_mul(x))`` in one kernel: x [M, 2 * d] ([gate | up]) -> (codes [M, d], float32
    scales [M, 1])."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be 2-D [M, 2 * d] ([gate | up]), got {tuple(x.shape)}")
    check_last_dim_contiguous("x", x)
    return _launch(OP_SILU_MUL, x, x.shape[1] // 2, fp8_dtype, fp8_max, min_scale)
