# Weight-only quantized GEMV (one row of x, W4A16 / W8A16): y[N] = dequantize(W)[N, K] @ x[K] (+ bias), reading the
# packed layout of rooflm/quantization/packed.py as 32-bit words.
#
# At batch 1 the product does two floating-point operations per weight element and reads half a byte (4 bits) of it,
# so the kernel must turn codes into products at memory speed: an H100 streams about 6e12 4-bit codes a second from
# HBM, and a code may cost only about two instructions. The general kernel (rooflm/kernels/quant_gemm.py)
# dequantizes every code to a float (code * scale + min) before its product; measured under Nsight Compute on a
# Llama-2-7B projection it executed 6.3 instructions a code and streamed 28-43% of the copy bandwidth.
#
# * Codes are read as int32 words (eight 4-bit or four 8-bit codes), in tiles of up to 128 words (512 bytes) of a
#   row: [BLOCK_N rows, GROUPS groups, GROUP_WORDS words], one scale and min a (row, group). Longer runs of a row
#   raised the ceiling of a pure load of the tiles (62-69% of the copy bandwidth at 64 bytes a row).
# * Scale and min leave the inner loop: within one group, sum_k (q_k s + m) x_k = s sum_k q_k x_k + m sum_k x_k, so a
#   program keeps a float32 accumulator per word and adds s * (the word's partial product) + m * (the word's partial
#   x sum): two FFMAs a word of eight codes, elementwise, with one cross-thread reduction at the very end.
# * On CUDA with float16 x (``asm``), a word's eight products are formed in float16x2 PTX (_W4_DOT8_ASM: about 17
#   instructions a word, against about 50 for the float32 form), with x arranged into the matching pairs once per
#   tile for all the program's rows (_X_PAIRS_ASM). Measured on an H100 (``python -m rooflm.kernels.bench_quant``):
#   37-71% of the copy bandwidth on Llama-2-7B's projections, about 4 instructions a code executed.
# * Elsewhere (float32 or bfloat16 x, and Triton's CPU interpreter, which cannot run PTX) a float32 form: a code
#   becomes a float *in place*, without a shift, by OR-ing the word, masked to the code's bits, into the mantissa of
#   2**23 and subtracting 2**23 (the "magic number" conversion; Kim et al. 2022, "Who Says Elephants Can't Run").
#   That yields code * 2**s for a code at bit s, exact while s + 4 <= 23; the 2**-s is folded into the x value the
#   code multiplies, scaled once per tile. Codes above bit 20 are shifted down once per word; signed 8-bit codes are
#   biased by 128 with one XOR per word and the bias is subtracted in the same FADD. Alone, this form was no faster
#   than the general kernel (38-46% at 4 bits): the instruction count, not the memory pattern, was the limit.
#
# K may be split over SPLIT programs (more loads in flight when N is small): partial sums go to a float32 workspace
# that the split-K reduction of rooflm/kernels/gemv.py adds in a fixed order, so results do not depend on scheduling.
# Whole tiles load unmasked; a tile that runs past K is masked (codes, x, scales and mins), and only that one.
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rooflm.kernels._utils import device_sms, interpreting
from rooflm.kernels.gemv import _splitk_reduce_kernel
from rooflm.quantization.packed import PackedWeight


@triton.jit
def _code(u, SHIFT: tl.constexpr, MASK: tl.constexpr, BIAS: tl.constexpr):
    """(code at bits SHIFT.. of the int32 words ``u``) * 2**SHIFT - BIAS * 2**SHIFT as float32, exact."""
    return ((u & (MASK << SHIFT)) | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + BIAS * (1 << SHIFT))


@triton.jit
def _xcol(x_ptr, cols, i: tl.constexpr, PER: tl.constexpr, SCALE: tl.constexpr, EVEN_K: tl.constexpr, K):
    """x at code i of each word (columns ``cols * PER + i``) in float32, times SCALE."""
    if EVEN_K:
        v = tl.load(x_ptr + cols * PER + i).to(tl.float32)
    else:
        v = tl.load(x_ptr + cols * PER + i, mask=cols * PER + i < K, other=0.0).to(tl.float32)
    return v * SCALE


@triton.jit
def _group_params(p_ptr, offs_n, mask_n, stride_sn, g, g_end, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    """Scales (or mins) of rows ``offs_n`` at groups ``g`` (those from ``g_end`` on lie past K): [BLOCK_N, GROUPS]
    float32, 0 where masked (a masked code is 0, and 0 times a stray value could be NaN)."""
    ptr = p_ptr + offs_n[:, None] * stride_sn + g[None, :]
    if EVEN_N and EVEN_K:
        v = tl.load(ptr)
    elif EVEN_K:
        v = tl.load(ptr, mask=mask_n[:, None], other=0.0)
    else:
        v = tl.load(ptr, mask=mask_n[:, None] & (g < g_end)[None, :], other=0.0)
    return v.to(tl.float32)


# Four codes' worth of float16x2 arithmetic per instruction (CUDA, float16 x): the 4-bit codes of a word become
# float16 pairs as in rooflm/kernels/int4_ptx.py (prmt, lop3 into the mantissa of 1024, sub.f16x2: exact), meet x in
# four fma.f16x2 and leave as one float32 (the two halves converted and added). The x pairs are arranged once per tile
# for every row of the program (_X_PAIRS_ASM): the word's nibble pairs are (0, 2), (4, 6), (1, 3), (5, 7) in the
# column order of the packed layout, x / 16 for low nibbles and x / 256 for high ones (read in place as 16 q), so a
# product is q x / 16 and four of them stay below 4 |x|: no float16 overflow below |x| = 16,000. The group's scale
# times 16 restores the magnitude. Each product is rounded to float16 (relative 2**-11, the rounding a float16
# dequantized weight has anyway) and a half sums four of them before the float32 accumulation; 17 instructions a
# word against about 50 in the float32 form below.
_W4_DOT8_ASM = tl.constexpr("""
{
.reg .b32 t, t2, c, l0, l1, h0, h1, a;
.reg .f16 lo, hi;
.reg .f32 f0, f1;
mov.b32 c, 0;
prmt.b32 t, $1, c, 0x3120;
shr.b32 t2, t, 8;
lop3.b32 l0, t, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 l1, t2, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 h0, t, 0x00F000F0, 0x64006400, 0xEA;
lop3.b32 h1, t2, 0x00F000F0, 0x64006400, 0xEA;
mov.b32 c, 0x64006400;
sub.f16x2 l0, l0, c;
sub.f16x2 l1, l1, c;
sub.f16x2 h0, h0, c;
sub.f16x2 h1, h1, c;
mul.rn.f16x2 a, l0, $2;
fma.rn.f16x2 a, l1, $3, a;
fma.rn.f16x2 a, h0, $4, a;
fma.rn.f16x2 a, h1, $5, a;
mov.b32 {lo, hi}, a;
cvt.f32.f16 f0, lo;
cvt.f32.f16 f1, hi;
add.f32 f0, f0, f1;
mov.b32 $0, f0;
}
""")
# x of one word as four float16x2 words (x0, x1), (x2, x3), (x4, x5), (x6, x7) in, the pairs the codes meet out
# (scaled as above), and the word's x sum in float32 (for the group's min).
_X_PAIRS_ASM = tl.constexpr("""
{
.reg .b32 a, b, c, d, s;
.reg .f16 e0, e1, e2, e3, e4, e5, e6, e7;
.reg .f32 f0, f1, f2, f3, f4, f5, f6, f7;
prmt.b32 a, $5, $6, 0x5410;
prmt.b32 b, $7, $8, 0x5410;
prmt.b32 c, $5, $6, 0x7632;
prmt.b32 d, $7, $8, 0x7632;
mov.b32 s, 0x2C002C00;
mul.rn.f16x2 a, a, s;
mul.rn.f16x2 b, b, s;
mov.b32 s, 0x1C001C00;
mul.rn.f16x2 c, c, s;
mul.rn.f16x2 d, d, s;
mov.b32 {e0, e1}, $5;
mov.b32 {e2, e3}, $6;
mov.b32 {e4, e5}, $7;
mov.b32 {e6, e7}, $8;
cvt.f32.f16 f0, e0;
cvt.f32.f16 f1, e1;
cvt.f32.f16 f2, e2;
cvt.f32.f16 f3, e3;
cvt.f32.f16 f4, e4;
cvt.f32.f16 f5, e5;
cvt.f32.f16 f6, e6;
cvt.f32.f16 f7, e7;
add.f32 f0, f0, f1;
add.f32 f2, f2, f3;
add.f32 f4, f4, f5;
add.f32 f6, f6, f7;
add.f32 f0, f0, f2;
add.f32 f4, f4, f6;
add.f32 f0, f0, f4;
mov.b32 $0, a;
mov.b32 $1, b;
mov.b32 $2, c;
mov.b32 $3, d;
mov.b32 $4, f0;
}
""")


@triton.jit
def _w4_f16x2(u, xw_ptr, cols, k_hi, MASK_K: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
              GROUP_WORDS: tl.constexpr):
    """Partial products (float32, q x / 16 summed over each word) and x sums of a tile of 4-bit words (CUDA only)."""
    xp = xw_ptr + cols * 4
    if MASK_K:
        live = cols * 8 < k_hi
        p0 = tl.load(xp, mask=live, other=0)
        p1 = tl.load(xp + 1, mask=live, other=0)
        p2 = tl.load(xp + 2, mask=live, other=0)
        p3 = tl.load(xp + 3, mask=live, other=0)
    else:
        p0 = tl.load(xp)
        p1 = tl.load(xp + 1)
        p2 = tl.load(xp + 2)
        p3 = tl.load(xp + 3)
    a, b, c, d, xs = tl.inline_asm_elementwise(_X_PAIRS_ASM, "=r,=r,=r,=r,=r,r,r,r,r", [p0, p1, p2, p3],
                                               dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.float32),
                                               is_pure=True, pack=1)
    shape: tl.constexpr = (BLOCK_N, GROUPS, GROUP_WORDS)
    p = tl.inline_asm_elementwise(_W4_DOT8_ASM, "=r,r,r,r,r,r",
                                  [u, tl.broadcast_to(a[None], shape), tl.broadcast_to(b[None], shape),
                                   tl.broadcast_to(c[None], shape), tl.broadcast_to(d[None], shape)],
                                  dtype=tl.float32, is_pure=True, pack=1)
    return p, xs


@triton.jit
def _words(rows, mask_n, wtile, k0, k_hi, PER: tl.constexpr, EVEN_N: tl.constexpr, MASK_K: tl.constexpr):
    """The [BLOCK_N, GROUPS, GROUP_WORDS] int32 words of the tile after column k0 (masked at k_hi if MASK_K)."""
    cols = k0 // PER + wtile  # word index along the row
    if MASK_K:
        u = tl.load(rows + cols[None, :, :], mask=mask_n[:, None, None] & (cols * PER < k_hi)[None, :, :], other=0)
    elif EVEN_N:
        u = tl.load(rows + cols[None, :, :])
    else:
        u = tl.load(rows + cols[None, :, :], mask=mask_n[:, None, None], other=0)
    return u


@triton.jit
def _tile(acc, u, x_ptr, xw_ptr, s_ptr, m_ptr, offs_n, mask_n, offs_g, wtile, k0, k_hi, GROUP, stride_sn,
          BITS: tl.constexpr, HAS_MIN: tl.constexpr, EVEN_N: tl.constexpr, MASK_K: tl.constexpr, ASM: tl.constexpr,
          BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, GROUP_WORDS: tl.constexpr):
    """acc + one tile's products: the codes ``u`` (``_words``) of the words ``wtile`` after column k0."""
    PER: tl.constexpr = 32 // BITS  # codes per word
    EVEN: tl.constexpr = not MASK_K
    cols = k0 // PER + wtile  # word index along the row
    if BITS == 4 and ASM:
        p, xs = _w4_f16x2(u, xw_ptr, cols, k_hi, MASK_K, BLOCK_N, GROUPS, GROUP_WORDS)
    elif BITS == 4:
        x0 = _xcol(x_ptr, cols, 0, PER, 1.0, EVEN, k_hi)
        x1 = _xcol(x_ptr, cols, 1, PER, 0.0625, EVEN, k_hi)
        x2 = _xcol(x_ptr, cols, 2, PER, 0.00390625, EVEN, k_hi)
        x3 = _xcol(x_ptr, cols, 3, PER, 0.000244140625, EVEN, k_hi)
        x4 = _xcol(x_ptr, cols, 4, PER, 0.0000152587890625, EVEN, k_hi)
        x5 = _xcol(x_ptr, cols, 5, PER, 1.0, EVEN, k_hi)
        x6 = _xcol(x_ptr, cols, 6, PER, 0.0625, EVEN, k_hi)
        x7 = _xcol(x_ptr, cols, 7, PER, 0.00390625, EVEN, k_hi)
        hi = (u.to(tl.uint32, bitcast=True) >> 20).to(tl.int32, bitcast=True)
        p = _code(u, 0, 0xF, 0.0) * x0[None]
        p += _code(u, 4, 0xF, 0.0) * x1[None]
        p += _code(u, 8, 0xF, 0.0) * x2[None]
        p += _code(u, 12, 0xF, 0.0) * x3[None]
        p += _code(u, 16, 0xF, 0.0) * x4[None]
        p += _code(hi, 0, 0xF, 0.0) * x5[None]
        p += _code(hi, 4, 0xF, 0.0) * x6[None]
        p += _code(hi, 8, 0xF, 0.0) * x7[None]
        xs = x0 + x1 * 16.0 + x2 * 256.0 + x3 * 4096.0 + x4 * 65536.0 + x5 + x6 * 16.0 + x7 * 256.0
    else:  # signed bytes: XOR 0x80 makes each byte q + 128, the FADD takes the 128 off
        x0 = _xcol(x_ptr, cols, 0, PER, 1.0, EVEN, k_hi)
        x1 = _xcol(x_ptr, cols, 1, PER, 0.00390625, EVEN, k_hi)
        x2 = _xcol(x_ptr, cols, 2, PER, 1.0, EVEN, k_hi)
        x3 = _xcol(x_ptr, cols, 3, PER, 0.00390625, EVEN, k_hi)
        ub = u ^ -2139062144  # 0x80808080 as int32
        hi = (ub.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)
        p = _code(ub, 0, 0xFF, 128.0) * x0[None]
        p += _code(ub, 8, 0xFF, 128.0) * x1[None]
        p += _code(hi, 0, 0xFF, 128.0) * x2[None]
        p += _code(hi, 8, 0xFF, 128.0) * x3[None]
        xs = x0 + x1 * 256.0 + x2 + x3 * 256.0
    g = k0 // GROUP + offs_g
    g_end = tl.cdiv(k_hi, GROUP)
    sc = _group_params(s_ptr, offs_n, mask_n, stride_sn, g, g_end, EVEN_N, EVEN)
    if BITS == 4 and ASM:
        sc = sc * 16.0  # the products were formed with x / 16 (see _W4_DOT8_ASM)
    acc += p * sc[:, :, None]
    if HAS_MIN:
        acc += _group_params(m_ptr, offs_n, mask_n, stride_sn, g, g_end, EVEN_N, EVEN)[:, :, None] * xs[None]
    return acc


@triton.jit
def _quant_gemv_kernel(
    x_ptr, xw_ptr, q_ptr, s_ptr, m_ptr, b_ptr, out_ptr,
    N, K, GROUP, k_per_split, stride_qn, stride_sn, stride_os,
    BITS: tl.constexpr, HAS_MIN: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
    GROUP_WORDS: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr,
):
    # A tile is [BLOCK_N rows, GROUPS groups, GROUP_WORDS words]: GROUPS > 1 only when a group is exactly
    # GROUP_WORDS words, so each (row, group) pair has one scale and min per tile. Whole tiles load unmasked; where
    # the tile does not divide K, the last one (from k_full on) is masked.
    PER: tl.constexpr = 32 // BITS  # codes per word
    TILE: tl.constexpr = GROUPS * GROUP_WORDS * PER  # columns of x per tile
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_g = tl.arange(0, GROUPS)
    wtile = offs_g[:, None] * GROUP_WORDS + tl.arange(0, GROUP_WORDS)[None, :]  # [GROUPS, GROUP_WORDS]
    rows = q_ptr + offs_n.to(tl.int64)[:, None, None] * stride_qn
    acc = tl.zeros([BLOCK_N, GROUPS, GROUP_WORDS], tl.float32)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    k_full = k_lo + (k_hi - k_lo) // TILE * TILE
    if PREFETCH:  # the next tile's words are loaded before this tile's products: two tiles in flight
        u = _words(rows, mask_n, wtile, k_lo, k_hi, PER, EVEN_N, True)  # masked: K may hold no whole tile
        last = tl.maximum(k_full - TILE, k_lo)
        for k0 in range(k_lo, k_full, TILE):
            u_next = _words(rows, mask_n, wtile, tl.minimum(k0 + TILE, last), k_hi, PER, EVEN_N, False)
            acc = _tile(acc, u, x_ptr, xw_ptr, s_ptr, m_ptr, offs_n, mask_n, offs_g, wtile, k0, k_hi, GROUP,
                        stride_sn, BITS, HAS_MIN, EVEN_N, False, ASM, BLOCK_N, GROUPS, GROUP_WORDS)
            u = u_next
    else:
        for k0 in range(k_lo, k_full, TILE):
            u = _words(rows, mask_n, wtile, k0, k_hi, PER, EVEN_N, False)
            acc = _tile(acc, u, x_ptr, xw_ptr, s_ptr, m_ptr, offs_n, mask_n, offs_g, wtile, k0, k_hi, GROUP,
                        stride_sn, BITS, HAS_MIN, EVEN_N, False, ASM, BLOCK_N, GROUPS, GROUP_WORDS)
    if not EVEN_K:
        if k_full < k_hi:
            u = _words(rows, mask_n, wtile, k_full, k_hi, PER, EVEN_N, True)
            acc = _tile(acc, u, x_ptr, xw_ptr, s_ptr, m_ptr, offs_n, mask_n, offs_g, wtile, k_full, k_hi, GROUP,
                        stride_sn, BITS, HAS_MIN, EVEN_N, True, ASM, BLOCK_N, GROUPS, GROUP_WORDS)
    res = tl.sum(tl.sum(acc, 2), 1)
    if HAS_BIAS and SPLIT == 1:
        res += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid_k * stride_os + offs_n, res.to(out_ptr.dtype.element_ty), mask=mask_n)


@dataclass(frozen=True)
class QuantGemvConfig:
    """One launch of the word GEMV: ``block_n`` rows of W per program, ``words`` 32-bit words of a row per tile,
    K split over ``split_k`` programs. A tile spans several groups only when a group is a power-of-two number of
    words (``tile_groups``)."""
    block_n: int
    words: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    asm: bool = True  # 4-bit codes with float16 x on CUDA: products in float16x2 PTX (see _W4_DOT8_ASM)
    prefetch: bool = False  # load tile i + 1's words before tile i's products (registers double-buffered)

    def __post_init__(self) -> None:
        for name in ("block_n", "words"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name}={v} must be a power of two")
        if self.split_k < 1:
            raise ValueError(f"split_k={self.split_k} must be >= 1")


def gemv_words(pw: PackedWeight) -> torch.Tensor | None:
    """``pw.qweight`` as int32 words [N, K * bits / 32], or None when its rows do not split into whole, aligned
    words (then the general kernel runs)."""
    q = pw.qweight
    if q.stride(-1) != 1 or q.shape[1] % 4 or q.stride(0) % 4 or q.data_ptr() % 16:
        return None
    return q.view(torch.int32)


def tile_groups(words: int, k: int, bits: int, group_size: int) -> tuple[int, int] | None:
    """(groups, words a group) of a tile of ``words`` words, or None when such a tile would straddle a group
    boundary inside a row (a group smaller than the tile and not a power-of-two number of words)."""
    per = 32 // bits
    if group_size == k or group_size % (words * per) == 0:
        return 1, words
    gw = group_size // per
    if group_size % per == 0 and gw & (gw - 1) == 0 and words % gw == 0:
        return words // gw, gw
    return None


def supports(x: torch.Tensor, pw: PackedWeight) -> bool:
    """True when the word GEMV can take ``x @ W.T``: one row of x, 4- or 8-bit codes in a word-aligned ``qweight``
    whose groups fit a tile (whole words a group, or one group a row: ``tile_groups`` then has a tile). Whether
    ``quant_linear`` sends it here is ``pick_gemv``'s choice. Called on every projection of an eager decode step,
    so it only reads attributes (about 1 us)."""
    if x.shape[0] != 1 or pw.bits not in (4, 8):
        return False
    q = pw.qweight
    return (q.stride(-1) == 1 and q.shape[1] % 4 == 0 and q.stride(0) % 4 == 0 and q.data_ptr() % 16 == 0
            and (pw.group_size % (32 // pw.bits) == 0 or pw.group_size == pw.in_features))


# The word GEMV's configuration is chosen per shape on the running device, as the float16 GEMV's is
# (rooflm/kernels/gemv.py): the first time a (N, K, bits, group) is seen outside a CUDA-graph capture, the static
# default and the few tiles that won a sweep on another card are timed (``python tests/gpu/quant_gemv_sweep.py``).
# Measured at one row on Llama-2-7B's projections: on an H100 the static default (16 rows, 512 bytes of a row a tile,
# four warps) won at 4 bits and the general kernel matched the word GEMV at 8 bits; on an H200, 16 rows of 256 bytes
# on two warps with the next tile's words loaded ahead (``prefetch``) was 9-11% faster on qkv and gate_up at 4 bits,
# and the word GEMV 5-8% faster than the general kernel at 8 bits. ``ROOFLM_QUANT_GEMV=default`` keeps the static
# choice (the word GEMV with ``default_gemv_config`` at 4 bits, the general kernel at 8).
_gemv_picked: dict[tuple, "QuantGemvConfig | None"] = {}


def gemv_candidates(n: int, k: int, bits: int, group_size: int, sms: int) -> list["QuantGemvConfig | None"]:
    """What ``pick_gemv`` times for an [n, k] weight: configurations of the word GEMV whose tiles fit the groups,
    and None (the general kernel) at 8 bits. The static choice comes first."""
    split = triton.cdiv(n, 16) < 2 * sms  # few rows: K splits keep more loads in flight
    if bits == 4:
        out: list[QuantGemvConfig | None] = [default_gemv_config(n, k, bits, group_size, sms),
                                              QuantGemvConfig(16, 64, 1, 2, 3, prefetch=True),
                                              QuantGemvConfig(32, 64, 1, 2, 3)]
        if split:
            out.append(QuantGemvConfig(16, 64, 4, 2, 3, prefetch=True))
    else:
        out = [None, QuantGemvConfig(8, 128, 1, 2, 3), QuantGemvConfig(16, 128, 1, 4, 3)]
        if split:
            out += [QuantGemvConfig(16, 128, 4, 2, 3), QuantGemvConfig(32, 128, 4, 4, 3)]
    return [c for c in out if c is None or tile_groups(c.words, k, bits, group_size) is not None]


def pick_gemv(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None) -> "QuantGemvConfig | None":
    """The word-GEMV configuration ``quant_linear`` runs one row of x with, or None for the general kernel
    (``supports(x, pw)`` must hold). Timed once per shape on CUDA (see above); elsewhere, inside a CUDA-graph
    capture, and with ``ROOFLM_QUANT_GEMV=default`` the static choice."""
    N, K = pw.out_features, pw.in_features
    key = (N, K, pw.bits, pw.group_size, pw.mins is not None, bias is not None, x.dtype, x.device)
    if key in _gemv_picked:
        return _gemv_picked[key]
    cands = gemv_candidates(N, K, pw.bits, pw.group_size, device_sms(x))
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    mode = os.environ.get("ROOFLM_QUANT_GEMV", "auto")
    if mode not in ("auto", "default"):
        raise ValueError(f"ROOFLM_QUANT_GEMV={mode!r}: expected 'auto' or 'default'")
    if not x.is_cuda or interpreting() or capturing or mode == "default" or len(cands) == 1:
        pick = cands[0]
    else:
        from rooflm.kernels.gemv import time_in_graph

        pick = fastest(x, pw, bias, cands, time_in_graph)
    if not capturing:
        _gemv_picked[key] = pick
    return pick


def packed_copies(pw: PackedWeight) -> list[PackedWeight]:
    """``pw`` plus copies enough to hold together about three L2s (at least two, at most eight), for timings in
    which each call streams its weight from device memory."""
    l2 = 64 * 2**20
    if pw.qweight.is_cuda:
        l2 = int(getattr(torch.cuda.get_device_properties(pw.qweight.device), "L2_cache_size", 0) or l2)
    n = max(2, min(8, -(-3 * l2 // pw.nbytes)))
    return [pw] + [PackedWeight(pw.qweight.clone(), pw.scales.clone(), None if pw.mins is None else pw.mins.clone(),
                                pw.bits, pw.group_size) for _ in range(n - 1)]


def fastest(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None, cands: list["QuantGemvConfig | None"],
            timer) -> "QuantGemvConfig | None":
    """The candidate with the smallest ``timer(call, weights, device)`` over copies of ``pw`` that together exceed
    the L2 (so the weight streams from device memory, as in a decode step); the first wins a tie."""
    from rooflm.kernels.quant_gemm import launch, pick_config

    copies = packed_copies(pw)
    xs = torch.randn_like(x)
    general = pick_config(xs, pw, bias)
    best: tuple[float, QuantGemvConfig | None] | None = None
    for c in cands:
        if c is None:
            t = timer(lambda w: launch(xs, w, bias, general), copies, x.device)
        else:
            t = timer(lambda w, c=c: launch_gemv(xs, w, bias, c), copies, x.device)
        if best is None or t < best[0]:
            best = (t, c)
    return best[1]


@functools.lru_cache(maxsize=None)
def default_gemv_config(n: int, k: int, bits: int, group_size: int, sms: int) -> QuantGemvConfig | None:
    """Block sizes for an [n, k] weight, or None when no tile fits the groups. From sweeps on an H100 over
    Llama-2-7B's projections at 4 bits, group 128 (``python -m rooflm.kernels.bench_quant``): 512 bytes of a row a
    tile (fewer only where the groups force it) and 16 rows a program; K split only where the rows alone give fewer
    than two programs an SM and K holds many tiles (``down``: 4096 rows, K = 11008, three ways on two warps: 16.3
    against 19.1 us unsplit on four)."""
    per = 32 // bits
    words = next((w for w in (128, 64, 32, 16, 8, 4, 2, 1) if tile_groups(w, k, bits, group_size) is not None), 0)
    if not words:
        return None
    tiles = k / (words * per)
    if triton.cdiv(n, 16) >= 2 * sms or tiles < 6:
        return QuantGemvConfig(16, words, 1, 4, 3)
    return QuantGemvConfig(16, words, max(1, min(8, round(tiles / 4))), 2, 3)


def launch_gemv(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None,
                cfg: QuantGemvConfig | None = None) -> torch.Tensor:
    """out [1, N] = x [1, K] @ dequantize(pw).T (+ bias); x already gathered by ``pw.perm``, contiguous."""
    N, K = pw.out_features, pw.in_features
    words = gemv_words(pw)
    if words is None or x.shape[0] != 1:
        raise ValueError(f"the word GEMV needs one row of x and a word-aligned qweight (x {tuple(x.shape)}, "
                         f"qweight {tuple(pw.qweight.shape)} strides {pw.qweight.stride()})")
    cfg = cfg or default_gemv_config(N, K, pw.bits, pw.group_size, device_sms(x))
    shape = None if cfg is None else tile_groups(cfg.words, K, pw.bits, pw.group_size)
    if shape is None:
        raise ValueError(f"{cfg}: no tile of this kernel fits group_size={pw.group_size} with K={K}")
    tile = cfg.words * 32 // pw.bits
    tiles = triton.cdiv(K, tile)
    split = max(1, min(cfg.split_k, tiles))
    k_per_split = triton.cdiv(tiles, split) * tile
    split = triton.cdiv(K, k_per_split)
    out = torch.empty(1, N, dtype=x.dtype, device=x.device)
    dst = out if split == 1 else torch.empty(split, 1, N, dtype=torch.float32, device=x.device)
    b = bias if bias is not None else pw.scales
    asm = (cfg.asm and pw.bits == 4 and x.dtype == torch.float16 and x.is_cuda and not interpreting()
           and x.data_ptr() % 4 == 0)
    xw = x.view(torch.int32) if asm else x
    _quant_gemv_kernel[(triton.cdiv(N, cfg.block_n), split)](
        x, xw, words, pw.scales, pw.mins if pw.mins is not None else pw.scales, b, dst,
        N, K, pw.group_size, k_per_split, words.stride(0), pw.scales.stride(0), N if split > 1 else 0,
        BITS=pw.bits, HAS_MIN=pw.mins is not None, HAS_BIAS=bias is not None, SPLIT=split,
        EVEN_N=N % cfg.block_n == 0, EVEN_K=K % tile == 0, BLOCK_N=cfg.block_n, GROUPS=shape[0],
        GROUP_WORDS=shape[1], ASM=asm, PREFETCH=cfg.prefetch, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split > 1:
        block = 1024
        _splitk_reduce_kernel[(1, triton.cdiv(N, block))](dst, b, out, 1, N, out.stride(0), SPLIT=split,
                                                       HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return out
