# Weight-only quantized matmul (W4A16 / W8A16): y[M, N] = x[M, K] @ dequantize(W)[N, K]^T (+ bias), reading W in
# the packed layout of rooflm/quantization/packed.py (codes, per-group scales and optional mins along K).
#
# At decode (M = batch <= 16) a linear layer is bound by reading its weight once; storing it in 4 or 8 bits cuts
# those bytes 4x or 2x against fp16 (Frantar et al. 2023, "GPTQ"; Lin et al. 2024, "AWQ"), so the kernel's job is to
# stream the codes at memory speed and keep the per-element dequantization cheap enough to hide under the loads.
# At prefill (M > 16) the layer is compute bound and the kernel must feed the tensor cores: it dequantizes a
# [BLOCK_N, BLOCK_K] tile of W into fp16/bf16 registers and hands it to tl.dot, accumulating in float32 -- the idea of
# Marlin (Frantar et al. 2024, "MARLIN: Mixed-Precision Auto-Regressive Parallel Inference on Large Language
# Models"), here without its hand-tuned memory layout: the weight is read in the packed layout every kernel shares.
#
# One kernel, three shapes of program (a program owns BLOCK_M rows of x and BLOCK_N rows of W, and loops over K in
# BLOCK_K tiles):
#   * BLOCK_M == 1 (M == 1, GEMV): the dequantized tile is multiplied by the x chunk elementwise and accumulated in a
#     float32 [BLOCK_N, BLOCK_K] register tile, reduced over K once at the end (no per-tile cross-thread reduction).
#   * BLOCK_M == 16 (2 <= M <= 16, flat GEMM, FlashDecoding++'s "flat GEMM", Hong et al. 2024): x is a 16-row tile
#     with the rows >= M masked, and the product goes through tl.dot, so one kernel serves every decode batch size.
#   * BLOCK_M >= 32 (M > 16, GEMM): the same with larger x tiles; programs along grid axis 0 share one W tile, so
#     consecutive programs hit it in L2 and W is read from device memory about once.
#   Any of them can split K over SPLIT programs (more programs in flight when N is small); the partial sums go to a
#   float32 workspace [SPLIT, M, N] that a second kernel adds in a fixed order, so results do not depend on scheduling.
#
# Reading int4: byte j of a row holds columns 2j (low nibble) and 2j + 1 (high nibble). X_SPLIT picks how the two
# halves meet x: 0 puts them back in column order in registers (tl.interleave) and multiplies x as loaded; 1 keeps
# them in byte order and loads the even and odd columns of x with stride 2 (two half-width products, or two tl.dot
# calls); 2 loads x contiguously and splits it in registers. On an H100 all three tie in the GEMV, and 0 is clearly
# the fastest with tl.dot (strided x tiles make poor tl.dot operands), so 0 is the default.
#
# Dequantize-then-multiply, not "factor the scale out of the group sum": both read exactly the same bytes (every code
# once, every scale and min once per row and group), so bytes per useful op do not separate them and the choice is
# decided by instructions per code -- at 4 bits the GPU has to retire two codes per byte read. Factoring
# (s * sum(q * x) + min * sum(x)) saves one FMA per code only if the partial sums are reduced across threads at every
# group boundary (a shuffle tree per group of 16..128 codes) and the x sums are formed per group, which costs more
# than the FMA it saves; dequantizing in registers (q * s + min, then * x, or into tl.dot) keeps the accumulation
# purely elementwise and is the same code for every group size. The integer-to-float conversion matters more: I2F
# issues at a fraction of the FMA rate, so a code becomes a float with the "magic number" trick (OR it into the
# mantissa of 2^23 and subtract 2^23: one integer op and one FADD, exact; Kim et al. 2022, "Who Says Elephants Can't
# Run: Bringing Large Scale MoE Models into Cloud Scale Production").
#
# Measured on an H100 (``python -m rooflm.kernels.bench_quant``, Llama-2-7B shapes, weights streamed from HBM,
# fractions of the device-to-device copy bandwidth, speed-ups over fp16 ``F.linear``):
#   M = 1:  W8A16 77-82% on qkv, gate_up, lm_head (52-70% on the short o and down calls), 1.5-1.8x;
#           W4A16 (group 128) 28-43%, 1.4-1.8x with the PTX conversion below (25-36%, 1.3-1.5x without).
#   M = 16: W8A16 48-82%, 1.4-1.9x; W4A16 25-49%, 1.3-2.1x with it (22-35%, 1.2-1.5x without).
#   M = 64: W8A16 0.8-1.2x and W4A16 0.7-1.0x of fp16 (the dequantization is paid once per 64 rows).
# With the float32 conversion both formats top out at about 2e12 codes/s: at 4 bits the kernel was bound by
# instructions per code. Converting two codes per 32-bit instruction into float16x2 registers (lop3 and HFMA2 in
# inline PTX, rooflm/kernels/int4_ptx.py; ``QuantMMConfig.asm``, default 2 for float16 on CUDA) cut the 4-bit GEMVs
# by 10-25%; the rest of the gap to W8A16's fraction is not the conversion (a sweep of tile shapes with it tops out at
# 41% on qkv). One row of 4-bit codes therefore goes to rooflm/kernels/quant_gemv.py (float16x2 products, 37-71%),
# and from 512 rows on (prefill) quant_linear dequantizes once and calls the float GEMM (kernels/quant_dequant.py).
#
# Scales: when a tile never straddles a group (group_size a multiple of BLOCK_K, or one group per row), each row's
# scale and min are one load per tile; otherwise (group_size < BLOCK_K, or not a power of two) they are gathered per
# column from L1 (index k // group_size), which works for any group size but is several times slower.
#
# Block sizes come from a small shape heuristic (``default_config``); ``pick_config`` can also time a few candidates
# once per shape bucket on the running GPU, outside CUDA-graph capture, like rooflm/kernels/gemv.py. Nothing in a call
# syncs with the host or allocates anything but the output, the split-K workspace and the gathered x (fixed sizes),
# so calls can be captured in a CUDA graph.
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from rooflm.kernels._utils import device_sms, interpreting
from rooflm.kernels.gemv import _splitk_reduce_kernel  # the fixed-order split-K sum, shared
from rooflm.kernels.int4_ptx import i4_to_f16, i4_to_f16_scaled
from rooflm.kernels.quant_dequant import dequant_linear, use_dequant_gemm
from rooflm.kernels.quant_gemv import launch_gemv, packed_copies, pick_gemv
from rooflm.kernels.quant_gemv import supports as gemv_supports
from rooflm.quantization.packed import PackedWeight


@triton.jit
def _u_to_f32(q):
    """Non-negative integer codes (< 2**23) -> float32, exactly, without I2F (see the header)."""
    return (q.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _s8_to_f32(q):
    """Signed int8 codes -> float32, exactly: 2**23 + 128 + q is a float with q + 128 in its low mantissa bits."""
    return (q.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _mma(a, b, F32: tl.constexpr):
    """tl.dot in float32 accumulation. F32: the inputs go in as float32 with exact (IEEE) products -- float32
    activations, and bf16 under Triton 3.9's CPU interpreter, whose bf16 tl.dot is wrong."""
    if F32:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        r = tl.dot(a, b)
    return r


@triton.jit
def _load_x(x_rows, cols, mask_m, mask_k, BLOCK_M: tl.constexpr, EVEN_K: tl.constexpr):
    """x at columns ``cols`` [W]: [W] for the GEMV (one row), [BLOCK_M, W] otherwise."""
    if BLOCK_M == 1:
        if EVEN_K:
            v = tl.load(x_rows + cols)
        else:
            v = tl.load(x_rows + cols, mask=mask_k, other=0.0)
    else:
        v = tl.load(x_rows + cols[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
    return v


@triton.jit(do_not_specialize=["M"])
def _quant_mm_kernel(
    x_ptr, q_ptr, s_ptr, m_ptr, b_ptr, out_ptr,
    M, N, K, GROUP, k_per_split,
    stride_xm, stride_qn, stride_sn, stride_om, stride_os,
    BITS: tl.constexpr, HAS_MIN: tl.constexpr, HAS_BIAS: tl.constexpr, PER_ROW: tl.constexpr,
    X_SPLIT: tl.constexpr, SPLIT: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    F32_DOT: tl.constexpr, ASM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # PER_ROW: the tile lies in one group (one scale and min a row), else they are gathered per column.
    # X_SPLIT (4 bits): 0 = the low and high nibbles are interleaved back into column order (tl.interleave) and meet
    # x as loaded; 1 = the nibbles stay in byte order and meet the even and odd columns of x, loaded with stride 2;
    # 2 = the same, with x loaded contiguously and split in registers.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    BYTE_ORDER: tl.constexpr = BITS == 4 and X_SPLIT > 0
    WIDTH: tl.constexpr = BLOCK_K // 2 if BITS == 4 else BLOCK_K  # bytes of a tile row
    offs_b = tl.arange(0, WIDTH)
    q_rows = q_ptr + offs_n.to(tl.int64)[:, None] * stride_qn
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    if BLOCK_M == 1:
        x_rows = x_ptr + pid_m * stride_xm
        if BYTE_ORDER:
            acc2 = tl.zeros([BLOCK_N, WIDTH], tl.float32)
        else:
            acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    else:
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)

    for k0 in range(k_lo, k_hi, BLOCK_K):
        k0 = tl.multiple_of(k0, BLOCK_K)  # k_per_split is a multiple of BLOCK_K
        cols = k0 + tl.arange(0, BLOCK_K)
        mask_k = cols < k_hi
        if BITS == 4:
            even = k0 + 2 * offs_b  # the column of each byte's low nibble
            bmask = even < k_hi
            qo = q_rows + (k0 // 2 + offs_b)[None, :]
        else:
            even = cols
            bmask = mask_k
            qo = q_rows + cols[None, :]
        if EVEN_K:
            if EVEN_N:
                q = tl.load(qo)
            else:
                q = tl.load(qo, mask=mask_n[:, None], other=0)
        else:
            q = tl.load(qo, mask=mask_n[:, None] & bmask[None, :], other=0)
        # scales and mins as float32, [BLOCK_N, 1] or [BLOCK_N, columns of the tile in the order used below]
        if PER_ROW:
            sp = offs_n * stride_sn + k0 // GROUP
            if EVEN_N:
                s = tl.load(s_ptr + sp).to(tl.float32)[:, None]
                if HAS_MIN:
                    mn = tl.load(m_ptr + sp).to(tl.float32)[:, None]
            else:
                s = tl.load(s_ptr + sp, mask=mask_n, other=0.0).to(tl.float32)[:, None]
                if HAS_MIN:
                    mn = tl.load(m_ptr + sp, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        else:
            if BYTE_ORDER:
                scol, smk = even, bmask
            else:
                scol, smk = cols, mask_k
            sp = offs_n[:, None] * stride_sn + (scol // GROUP)[None, :]
            smask = mask_n[:, None] & smk[None, :]
            s = tl.load(s_ptr + sp, mask=smask, other=0.0).to(tl.float32)
            if HAS_MIN:
                mn = tl.load(m_ptr + sp, mask=smask, other=0.0).to(tl.float32)
        if not HAS_MIN:
            mn = 0.0

        if BYTE_ORDER:
            if ASM == 1:
                lo, hi = i4_to_f16(q)
                w_lo = lo.to(tl.float32) * s + mn
                w_hi = hi.to(tl.float32) * s + mn
            elif ASM == 2:  # PER_ROW: s and mn are [BLOCK_N, 1]
                w_lo, w_hi = i4_to_f16_scaled(q, tl.broadcast_to(s.to(tl.float16), q.shape),
                                               tl.broadcast_to((s * 0.0 + mn).to(tl.float16), q.shape))
            else:
                w_lo = _u_to_f32(q & 0xF) * s + mn
                w_hi = _u_to_f32(q >> 4) * s + mn
            if X_SPLIT == 1:
                x_lo = _load_x(x_rows, even, mask_m, bmask, BLOCK_M, EVEN_K)
                x_hi = _load_x(x_rows, even + 1, mask_m, bmask, BLOCK_M, EVEN_K)
            else:
                xv = _load_x(x_rows, cols, mask_m, mask_k, BLOCK_M, EVEN_K)
                if BLOCK_M == 1:
                    x_lo, x_hi = tl.split(tl.reshape(xv, [WIDTH, 2]))
                else:
                    x_lo, x_hi = tl.split(tl.reshape(xv, [BLOCK_M, WIDTH, 2]))
            if BLOCK_M == 1:
                acc2 += w_lo * x_lo.to(tl.float32)[None, :] + w_hi * x_hi.to(tl.float32)[None, :]
            else:
                acc += _mma(x_lo, tl.trans(w_lo.to(x_ptr.dtype.element_ty)), F32_DOT)
                acc += _mma(x_hi, tl.trans(w_hi.to(x_ptr.dtype.element_ty)), F32_DOT)
        else:
            if BITS == 4:
                if ASM == 1:
                    lo, hi = i4_to_f16(q)
                    w = tl.interleave(lo, hi).to(tl.float32) * s + mn
                elif ASM == 2:  # PER_ROW: s and mn are [BLOCK_N, 1]
                    s16 = tl.broadcast_to(s.to(tl.float16), q.shape)
                    m16 = tl.broadcast_to((s * 0.0 + mn).to(tl.float16), q.shape)
                    lo, hi = i4_to_f16_scaled(q, s16, m16)
                    w = tl.interleave(lo, hi)
                else:
                    w = tl.interleave(_u_to_f32(q & 0xF), _u_to_f32(q >> 4)) * s + mn
            else:
                w = _s8_to_f32(q) * s + mn
            xv = _load_x(x_rows, cols, mask_m, mask_k, BLOCK_M, EVEN_K)
            if BLOCK_M == 1:
                acc2 += w * xv.to(tl.float32)[None, :]
            else:
                acc += _mma(xv, tl.trans(w.to(x_ptr.dtype.element_ty)), F32_DOT)

    if BLOCK_M == 1:
        res = tl.sum(acc2, 1)
        if HAS_BIAS and SPLIT == 1:
            res += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(out_ptr + pid_k * stride_os + pid_m * stride_om + offs_n, res.to(out_ptr.dtype.element_ty),
                 mask=mask_n)
    else:
        if HAS_BIAS and SPLIT == 1:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        o = out_ptr + pid_k * stride_os + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# ---------------------------------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------------------------------
MAX_GEMV_M = 16  # up to this many rows the flat kernels (BLOCK_M 1 or 16) stream W once


@dataclass(frozen=True)
class QuantMMConfig:
    """One launch configuration. block_m: 1 (M == 1 only: elementwise GEMV), 16 (M <= 16: flat GEMM on tl.dot) or
    a larger power of two (GEMM tiles of x). block_k counts weight columns (a 4-bit tile reads block_k // 2 bytes a
    row)."""
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    x_split: int = 0
    asm: int = 0  # 4 bits, float16 x on CUDA: 1 = codes via PTX (lop3), 2 = also scale and min in f16x2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name}={v} must be a power of two")
        if self.block_m not in (1,) and self.block_m < 16:
            raise ValueError(f"block_m={self.block_m} must be 1 or at least 16 (tl.dot tiles)")
        if self.block_k < 16 or (self.block_m > 1 and (self.block_n < 16 or self.block_k < 32)):
            raise ValueError(f"block_k={self.block_k} must be >= 16, and block_n={self.block_n} >= 16 and block_k "
                             ">= 32 with tl.dot")
        if self.x_split not in (0, 1, 2):
            raise ValueError(f"x_split={self.x_split} must be 0, 1 or 2")
        if self.split_k < 1:
            raise ValueError(f"split_k={self.split_k} must be >= 1")
        if self.asm not in (0, 1, 2):
            raise ValueError(f"asm={self.asm} must be 0, 1 or 2")

    def supports(self, m: int) -> bool:
        return m == 1 if self.block_m == 1 else m >= 1


def check_packed(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None) -> None:
    """ValueError naming the field when x, pw and bias do not fit together or the kernel cannot read them."""
    if x.dim() != 2 or x.shape[1] != pw.in_features:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected [M, {pw.in_features}] (pw.in_features)")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x.dtype={x.dtype} is not supported: expected float16, bfloat16 or float32")
    if pw.bits == 4 and pw.group_size % 2:
        raise ValueError(f"group_size={pw.group_size} must be even for 4-bit codes (a byte holds two columns)")
    for name, t in (("qweight", pw.qweight), ("scales", pw.scales), ("mins", pw.mins), ("perm", pw.perm)):
        if t is not None and (t.device != x.device or t.stride(-1) != 1):
            raise ValueError(f"pw.{name} must be on {x.device} and contiguous in its last dim "
                             f"(device {t.device}, strides {tuple(t.stride())})")
    if bias is not None and (tuple(bias.shape) != (pw.out_features,) or bias.device != x.device):
        raise ValueError(f"bias has shape {tuple(bias.shape)} on {bias.device}, expected ({pw.out_features},) "
                         f"on {x.device}")


def per_row_scales(cfg: QuantMMConfig, k: int, group_size: int) -> bool:
    """True when no tile straddles a group (group_size a multiple of block_k, or one group a row): one scale and min
    load a row and tile; otherwise they are gathered per column."""
    return group_size == k or group_size % cfg.block_k == 0


def asm_level(cfg: QuantMMConfig, x: torch.Tensor, pw: PackedWeight, per_row: bool) -> int:
    """The PTX conversion ``cfg.asm`` asks for where it applies (4-bit codes, float16 x on a CUDA device; level 2 also
    needs one scale a row and tile), else 0: the float32 conversion, which runs everywhere."""
    if cfg.asm == 0 or pw.bits != 4 or x.dtype != torch.float16 or not x.is_cuda or interpreting():
        return 0
    return cfg.asm if cfg.asm == 1 or per_row else 1


def launch(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None, cfg: QuantMMConfig) -> torch.Tensor:
    """out = x @ dequantize(pw, stored column order).T (+ bias) with one configuration; x [M, K] already gathered by
    pw.perm and contiguous in its last dim. Callers check shapes (``check_packed``)."""
    M, K = x.shape
    N = pw.out_features
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    if not cfg.supports(M):
        raise ValueError(f"{cfg} does not support M={M} (block_m=1 is for a single row)")
    bk = cfg.block_k
    k_tiles = triton.cdiv(K, bk)
    split = max(1, min(cfg.split_k, k_tiles))
    k_per_split = triton.cdiv(k_tiles, split) * bk
    split = triton.cdiv(K, k_per_split)
    G = pw.group_size
    if split == 1:
        dst, stride_s = out, 0
    else:
        dst = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
        stride_s = dst.stride(0)
    b = bias if bias is not None else pw.scales
    f32_dot = x.dtype == torch.float32 or (interpreting() and x.dtype == torch.bfloat16)
    per_row = per_row_scales(cfg, K, G)
    asm = asm_level(cfg, x, pw, per_row)
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(N, cfg.block_n), split)
    _quant_mm_kernel[grid](
        x, pw.qweight, pw.scales, pw.mins if pw.mins is not None else pw.scales, b, dst,
        M, N, K, G, k_per_split, x.stride(0), pw.qweight.stride(0), pw.scales.stride(0), dst.stride(-2), stride_s,
        BITS=pw.bits, HAS_MIN=pw.mins is not None, HAS_BIAS=bias is not None, PER_ROW=per_row,
        X_SPLIT=cfg.x_split, SPLIT=split,
        EVEN_N=N % cfg.block_n == 0, EVEN_K=K % bk == 0, F32_DOT=f32_dot, ASM=asm,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split > 1:
        block = 1024
        _splitk_reduce_kernel[(M, triton.cdiv(N, block))](dst, b, out, M, N, out.stride(0), SPLIT=split,
                                                       HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return out


def _within_groups(bk: int, k: int, group_size: int, least: int) -> int:
    """The largest power of two <= bk (and >= least) whose tiles never straddle a group, else bk (scales gathered)."""
    if group_size == k:
        return bk
    b = bk
    while b > least and group_size % b:
        b //= 2
    return b if group_size % b == 0 else bk


def default_asm(bits: int, x_split: int) -> int:
    """The PTX conversion level of 4-bit tiles: ``ROOFLM_QUANT_ASM`` (0, 1 or 2), default 2 (see the header for what
    each does and ``asm_level`` for where it applies)."""
    level = os.environ.get("ROOFLM_QUANT_ASM", "2")
    if level not in ("0", "1", "2"):
        raise ValueError(f"ROOFLM_QUANT_ASM={level!r}: expected 0, 1 or 2")
    return int(level) if bits == 4 else 0


def default_config(m: int, n: int, k: int, bits: int, group_size: int, sms: int) -> QuantMMConfig:
    """A shape heuristic, from a sweep on an H100 over Llama-2-7B's projections (``python -m
    rooflm.kernels.bench_quant --sweep``). M == 1: 32 rows x 128 columns at 4 bits, 16 x 256 at 8 bits; M <= 16:
    16-row tl.dot tiles of 128 columns; M > 16: GEMM tiles of 64 columns (64 rows of W at 4 bits, where the
    dequantization is the larger cost, 128 at 8). Tiles shrink to fit inside one group where the group allows
    (one scale load a row and tile instead of a gather). The GEMV splits K until the grid holds about four programs
    per SM, the flat GEMM two (enough loads in flight when N is small); the GEMM splits below two programs per SM.
    4-bit tiles are put back in column order (x_split 0): measured the fastest with tl.dot, on par for the GEMV."""
    kp2 = max(32, triton.next_power_of_2(k))
    if m > MAX_GEMV_M:
        bm = 64 if m <= 64 else 128
        bn = 128 if n >= 128 and bits == 8 else 64
        bk = _within_groups(min(64, kp2), k, group_size, 32)
        programs = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        split = max(1, min(triton.cdiv(2 * sms, programs), triton.cdiv(k, bk), 4))
        return QuantMMConfig(bm, bn, bk, split, 8 if bm == 128 else 4, 3, x_split=0, asm=default_asm(bits, 0))
    x_split = 0
    if m == 1:
        bm, bn, bk, warps, stages, waves = 1, (32 if bits == 4 else 16), min(128 if bits == 4 else 256, kp2), 4, 3, 4
        bk = _within_groups(bk, k, group_size, 32)
        if bk == 32 and bits == 4:  # narrow rows (groups of 32): more of them, x split in registers
            bn, x_split = 64, 2
    else:
        bm, bn, bk, warps, stages, waves = 16, (64 if n >= 16384 else 32), min(128, kp2), 4, 4, 2
        bk = _within_groups(bk, k, group_size, 32)
    programs = triton.cdiv(n, bn)
    split = max(1, min(triton.cdiv(waves * sms, programs), triton.cdiv(k, bk), 8))
    return QuantMMConfig(bm, bn, bk, split, warps, stages, x_split, asm=default_asm(bits, x_split))


_picked: dict[tuple, QuantMMConfig] = {}


def _m_bucket(m: int) -> int:
    return 1 if m == 1 else (16 if m <= MAX_GEMV_M else 1 << max(0, m - 1).bit_length())


def pick_config(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None) -> QuantMMConfig:
    """The configuration ``quant_linear`` uses: ``default_config``, or with ``ROOFLM_QUANT_TUNE=1`` on CUDA the fastest
    of a few candidates, timed once per (M bucket, N, K, bits, group, dtype) outside any CUDA-graph capture."""
    M, K = x.shape
    N = pw.out_features
    key = (_m_bucket(M), N, K, pw.bits, pw.group_size, pw.mins is not None, x.dtype, x.device)
    cfg = _picked.get(key)
    if cfg is not None:
        return cfg
    cfg = default_config(M, N, K, pw.bits, pw.group_size, device_sms(x))
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if os.environ.get("ROOFLM_QUANT_TUNE", "0") == "1" and x.is_cuda and not interpreting() and not capturing:
        cfg = _time_candidates(x, pw, bias, cfg)
    if not capturing:
        _picked[key] = cfg
    return cfg


def candidates(m: int, n: int, k: int, bits: int, group_size: int, sms: int) -> list[QuantMMConfig]:
    """The default configuration and a few neighbours (tile height, split) for the one-time timing."""
    base = default_config(m, n, k, bits, group_size, sms)
    out = [base]
    for bn in (base.block_n // 2, base.block_n * 2):
        if (bn >= 16 or (bn >= 1 and base.block_m == 1)) and bn <= 128:
            out.append(replace(base, block_n=bn))
    for split in (1, 2 * base.split_k):
        if split != base.split_k:
            out.append(replace(base, split_k=split))
    if bits == 4:
        out += [replace(base, x_split=x) for x in (0, 1, 2) if x != base.x_split]
    return out


def _time_candidates(x, pw, bias, base: QuantMMConfig) -> QuantMMConfig:
    from rooflm.kernels.gemv import time_in_graph

    M, K = x.shape
    xs = torch.randn(_m_bucket(M), K, dtype=x.dtype, device=x.device)
    copies = packed_copies(pw)  # together about three L2s: W comes from device memory
    best = (float("inf"), base)
    for cfg in candidates(xs.shape[0], pw.out_features, K, pw.bits, pw.group_size, device_sms(x)):
        t = time_in_graph(lambda w, c=cfg: launch(xs, w, bias, c), copies, x.device)
        best = min(best, (t, cfg), key=lambda r: r[0])
    return best[1]


def quant_linear(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None,
                 cfg: QuantMMConfig | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for a packed weight W, in x's dtype (the contract of ``quant_linear_reference``).
    x [M, K] (or [..., K]) float16, bfloat16 or float32, on the device of ``pw``; ``cfg`` forces a configuration."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]) if x.dim() != 2 else x
    check_packed(x2, pw, bias)
    if pw.perm is not None:
        x2 = x2.index_select(1, pw.perm)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if cfg is None and gemv_supports(x2, pw):  # one row: the word GEMV where faster (rooflm/kernels/quant_gemv.py)
        word = pick_gemv(x2, pw, bias)
        if word is not None:
            return launch_gemv(x2, pw, bias, word).view(*shape[:-1], pw.out_features)
    if cfg is None and use_dequant_gemm(x2):  # many rows: dequantize once, float GEMM (kernels/quant_dequant.py)
        return dequant_linear(x2, pw, bias).view(*shape[:-1], pw.out_features)
    cfg = cfg or pick_config(x2, pw, bias)
    return launch(x2, pw, bias, cfg).view(*shape[:-1], pw.out_features)
