# The one-row 4-bit GEMV on tensor cores (CUDA, float16 activations): y[N] = dequantize(W)[N, K] @ x[K] (+ bias).
#
# Why tensor cores at batch 1. The word GEMV of rooflm/kernels/quant_gemv.py forms a word's eight products on the
# CUDA cores: about 10 instructions turn its codes into float16 pairs and 4 float16x2 multiply-adds take the products,
# and with the conversion of each sum to float32, the scale, the min and the x pairs it executed 26-28 instructions a
# word (counted in its machine code) -- about what an H200 can issue a word at its read rate, so it streamed at 29-59%
# of the bandwidth. Here the products go to the tensor cores as in Marlin (Frantar et al. 2024, "MARLIN: Mixed-
# Precision Auto-Regressive Parallel Inference on Large Language Models"): one ``mma.sync.m16n8k16`` takes 16 rows x
# 16 columns of W (one word of eight codes from each of the warp's 32 threads) against x, so a word costs its
# conversion to float16 weights (13 instructions) and a share of one mma. Seven of the mma's eight columns of x are
# wasted; the tensor cores have room for that at one row.
#
# * Layout (``pack_mma``, once at load time, ``with_mma``): the codes of each 16-row block are stored in the order of
#   the mma's A fragment (PTX ISA, "Matrix Fragments for mma.m16n8k16"), so the word a thread loads is its fragment:
#   thread l (g = l // 4, t = l % 4) holds rows g and g + 8 at two column pairs of the k-step. Which 16 columns of a
#   group form a k-step is free (the scale and min are the group's): k-step 4 h + j of group kg takes columns
#   128 kg + 32 t + 16 h + 2 j + {0, 1} and the same + 8, so the x pairs of a thread's B fragment for four k-steps
#   are four consecutive 32-bit words of x and load in one 16-byte access, as do its four words of codes. A 16-row
#   block of one group is 1 KiB, read as two fully coalesced 512-byte runs.
# * Codes to weights in float16x2 without a shift a code ("Who Says Elephants Can't Run", Kim et al. 2022): lop3 puts
#   two nibbles under the exponent of 1024.0 (the high ones read as 16 q), a subtraction (or an FMA by 1/16) leaves
#   q exactly, and one FMA with the (row, group) scale and min gives q * s + m -- the float16 weight the reference
#   dequantization makes, rounded once. The mma multiplies those weights by x exactly and accumulates in float32, so
#   the result is the float16-dequantized product up to the order of float32 additions (closer to the reference than
#   the word GEMV, whose float16 products are rounded).
# * The loop is Triton's and the rest is PTX: an mma needs each thread of the warp to hold its own fragment, and
#   which thread holds which element of a Triton tensor is the compiler's choice (Triton 3.6 and 3.9 laid out the
#   same tile differently, and the first lost the fragments). So Triton only hands each warp one-element values
#   that are the same for all its threads (addresses of a group, of a row of scales), and the PTX reads %laneid
#   and %tid to load its own codes, x pairs and scales. Each warp takes one 16-row block, each loop iteration one
#   group (the next group's codes loaded first), and K is split over programs (split-K reduction of
#   rooflm/kernels/gemv.py, in a fixed order) until the grid holds thousands of warps.
#
# Measured on an H100 (docs/benchmarks.md): a largest error of 2.5e-4 of the largest output against the float64
# reference (the word GEMV 1.0e-3 to 1.5e-3), and in time at parity with the word GEMV (qkv 14.5 against 14.2-14.5
# us, down 14.4 against 14.8-15.0, o 8.5 against 7.8-8.0, gate_up 24.0 against 22.4-22.8). With about half the
# instructions a code the stream is no faster, so the word GEMV is not held back by its instructions: each of these
# kernels takes 5-7 us more than its bytes need at the read rate (launch, first loads, last wave), whatever it
# executes in between. The layout is a second copy of the codes, so it is off unless ``ROOFLM_QUANT_MMA=1`` (then
# ``pick_gemv`` times this kernel beside the word GEMV on each shape and keeps the faster).
#
# Requirements (``supports_mma``): 4-bit codes, float16 scales (and mins), K a multiple of 128, groups of 128 columns
# (or a multiple, or one per row), N a multiple of 16. Elsewhere the word GEMV runs.
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from rooflm.kernels._tl import pdl_edges, pdl_launch, pdl_trigger_late
from rooflm.kernels._utils import check_tiles
from rooflm.kernels.gemv import _splitk_reduce_kernel
from rooflm.quantization.packed import PackedWeight, unpack_int4

# Where a thread is (see the header): l its lane, w its warp in the program, g = l / 4, t = l % 4.
_LANE = """
mov.u32 l, %laneid;
mov.u32 w, %tid.x;
shr.u32 w, w, 5;
and.b32 t, l, 3;
shr.u32 g, l, 2;
"""

# A group's codes for this thread: two 16-byte loads (halves h = 0, 1 of the group: k-steps 4 h + j, j = 0..3), from
# the group's address in block 0 of the program ($8) plus the warp's block (w * $9 bytes) and the thread's 16 bytes.
_LOAD_PTX = tl.constexpr("{\n.reg .u32 l, w, t, g;\n.reg .u64 a, o;\n" + _LANE + """
mul.wide.u32 o, w, $9;
add.u64 a, $8, o;
mul.wide.u32 o, l, 16;
add.u64 a, a, o;
ld.global.nc.v4.u32 {$0, $1, $2, $3}, [a];
ld.global.nc.v4.u32 {$4, $5, $6, $7}, [a+512];
}
""")


def _group_ptx(has_min: bool) -> str:
    """PTX of one group of a thread: its eight words ($4-$11) to float16 weights and eight mmas against x.
    $0-$3 the sums out (rows g and g + 8 of the warp's block; two chains, halves 0 and 1), $16-$19 in; $12 the
    group's x pairs; $13 the scale of the program's first row at this group, $14 a row of scales in bytes; $15 the
    mins (as $13)."""
    lines = ["{", ".reg .u32 l, w, t, g, r;", ".reg .b32 a0, a1, a2, a3, k0, k1, k2, sl, sh, ml, mh;",
             ".reg .u64 a, o;", ".reg .b32 x<16>;", ".reg .b16 s0, s1, m0, m1;", ".reg .f32 d1, d3;", _LANE,
             "mov.f32 $0, $16;", "mov.f32 $1, $17;", "mov.f32 $2, $18;", "mov.f32 $3, $19;",
             "mov.b32 k0, 0x64006400;", "mov.b32 k1, 0x2C002C00;", "mov.b32 k2, 0xD400D400;",
             "mul.wide.u32 o, t, 64;", "add.u64 a, $12, o;",
             "ld.global.v4.b32 {x0, x1, x2, x3}, [a];", "ld.global.v4.b32 {x4, x5, x6, x7}, [a+16];",
             "ld.global.v4.b32 {x8, x9, x10, x11}, [a+32];", "ld.global.v4.b32 {x12, x13, x14, x15}, [a+48];",
             "shl.b32 r, w, 4;", "add.u32 r, r, g;",  # the row of the program's first block this thread's lo is
             "mul.wide.u32 o, r, $14;", "add.u64 a, $13, o;", "ld.global.b16 s0, [a];",
             "mul.wide.u32 o, $14, 8;", "add.u64 a, a, o;", "ld.global.b16 s1, [a];",
             "mov.b32 sl, {s0, s0};", "mov.b32 sh, {s1, s1};"]
    if has_min:
        lines += ["mul.wide.u32 o, r, $14;", "add.u64 a, $15, o;", "ld.global.b16 m0, [a];",
                  "mul.wide.u32 o, $14, 8;", "add.u64 a, a, o;", "ld.global.b16 m1, [a];",
                  "mov.b32 ml, {m0, m0};", "mov.b32 mh, {m1, m1};"]
    else:
        lines += ["mov.b32 ml, 0;", "mov.b32 mh, 0;"]
    for h in range(2):
        lo, hi = f"${2 * h}", f"${2 * h + 1}"
        for j in range(4):
            u = f"${4 + 4 * h + j}"
            lines += [f"lop3.b32 a0, {u}, 0x000F000F, 0x64006400, 0xEA;",
                      f"lop3.b32 a1, {u}, 0x00F000F0, 0x64006400, 0xEA;", f"shr.u32 r, {u}, 8;",
                      "lop3.b32 a2, r, 0x000F000F, 0x64006400, 0xEA;", "lop3.b32 a3, r, 0x00F000F0, 0x64006400, 0xEA;",
                      "sub.f16x2 a0, a0, k0;", "fma.rn.f16x2 a1, a1, k1, k2;", "sub.f16x2 a2, a2, k0;",
                      "fma.rn.f16x2 a3, a3, k1, k2;", "fma.rn.f16x2 a0, a0, sl, ml;", "fma.rn.f16x2 a1, a1, sh, mh;",
                      "fma.rn.f16x2 a2, a2, sl, ml;", "fma.rn.f16x2 a3, a3, sh, mh;",
                      f"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{{lo}, d1, {hi}, d3}}, {{a0, a1, a2, a3}}, "
                      f"{{x{8 * h + j}, x{8 * h + 4 + j}}}, {{{lo}, {lo}, {hi}, {hi}}};"]
    return "\n".join(lines + ["}"])


_GROUP_PTX = tl.constexpr(_group_ptx(True))
_GROUP_PTX_NO_MIN = tl.constexpr(_group_ptx(False))


def _store_ptx(f32: bool, bias: bool) -> str:
    """PTX that writes a thread's two sums ($1 row g, $2 row g + 8 of the warp's block; the threads with t = 0) to
    the output row at $3 (the program's first row), as float32 or rounded to float16, after adding the bias at $4."""
    size = 4 if f32 else 2
    lines = ["{", ".reg .u32 l, w, t, g, r;", ".reg .u64 a, o, b;", ".reg .pred p;", ".reg .b16 h0, h1;",
             ".reg .f32 y0, y1, v;", _LANE, "setp.eq.u32 p, t, 0;", "shl.b32 r, w, 4;", "add.u32 r, r, g;",
             f"mul.wide.u32 o, r, {size};", "add.u64 a, $3, o;", "mov.f32 y0, $1;", "mov.f32 y1, $2;"]
    if bias:
        lines += ["mul.wide.u32 o, r, 2;", "add.u64 b, $4, o;", "@p ld.global.b16 h0, [b];",
                  "@p ld.global.b16 h1, [b+16];", "cvt.f32.f16 v, h0;", "add.f32 y0, y0, v;", "cvt.f32.f16 v, h1;",
                  "add.f32 y1, y1, v;"]
    if f32:
        lines += ["@p st.global.f32 [a], y0;", "@p st.global.f32 [a+32], y1;"]
    else:
        lines += ["cvt.rn.f16.f32 h0, y0;", "cvt.rn.f16.f32 h1, y1;", "@p st.global.b16 [a], h0;",
                  "@p st.global.b16 [a+16], h1;"]
    return "\n".join(lines + ["mov.u32 $0, 0;", "}"])


_STORE_F16 = tl.constexpr(_store_ptx(False, False))
_STORE_F16_BIAS = tl.constexpr(_store_ptx(False, True))
_STORE_F32 = tl.constexpr(_store_ptx(True, False))  # split K: partial sums to the float32 workspace, no bias


@triton.jit
def _one(v):
    """The scalar ``v`` as a one-element tensor: the same value in every thread."""
    return v + tl.zeros([1], tl.int32)


@triton.jit
def _addr(p):
    """The pointer ``p`` as a one-element int64 tensor (an address operand of the PTX above)."""
    return (p + tl.zeros([1], tl.int32)).to(tl.int64, bitcast=True)


@triton.jit
def _load_group(q, kg, block_bytes):
    """The thread's eight words of codes of group kg (``_LOAD_PTX``)."""
    return tl.inline_asm_elementwise(_LOAD_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,l,r", [_addr(q + kg * 256), block_bytes],
                                     dtype=(tl.int32,) * 8, is_pure=False, pack=1)


@triton.jit
def _w4_mma_gemv_kernel(xw_ptr, q_ptr, s_ptr, m_ptr, b_ptr, out_ptr, N, K, groups_per_split, stride_sn, stride_os,
                        GSTEP: tl.constexpr, HAS_MIN: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                        WARPS: tl.constexpr, PREFETCH: tl.constexpr, TRIGGER: tl.constexpr = 0,
                        WAIT: tl.constexpr = False):
    pdl_edges(TRIGGER, WAIT)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    row0 = pid_n * WARPS * 16  # the program's first row; warp w takes rows row0 + 16 w ..
    q = q_ptr + row0.to(tl.int64) * (K // 8)  # block b's words start at b * 2 K (K / 8 words a row)
    block_bytes = _one(2 * K * 4)
    sp = s_ptr + row0.to(tl.int64) * stride_sn
    mp = m_ptr + row0.to(tl.int64) * stride_sn
    row_bytes = _one(stride_sn * 2)
    g_lo = pid_k * groups_per_split
    g_hi = tl.minimum(g_lo + groups_per_split, K // 128)
    c0 = tl.zeros([1], tl.float32)
    c1 = c0
    c2 = c0
    c3 = c0
    if PREFETCH:
        u0, u1, u2, u3, u4, u5, u6, u7 = _load_group(q, g_lo, block_bytes)
    for kg in range(g_lo, g_hi):
        if PREFETCH:  # the next group's codes are loaded before this group's products
            n0, n1, n2, n3, n4, n5, n6, n7 = _load_group(q, tl.minimum(kg + 1, g_hi - 1), block_bytes)
        else:
            u0, u1, u2, u3, u4, u5, u6, u7 = _load_group(q, kg, block_bytes)
        grp = kg // GSTEP if GSTEP > 0 else 0  # the scales' column: GSTEP groups of 128 a scale (0: one a row)
        c0, c1, c2, c3 = tl.inline_asm_elementwise(
            _GROUP_PTX if HAS_MIN else _GROUP_PTX_NO_MIN, "=f,=f,=f,=f" + ",r" * 8 + ",l,l,r,l,f,f,f,f",
            [u0, u1, u2, u3, u4, u5, u6, u7, _addr(xw_ptr + kg * 64), _addr(sp + grp), row_bytes, _addr(mp + grp),
             c0, c1, c2, c3], dtype=(tl.float32,) * 4, is_pure=False, pack=1)
        if PREFETCH:
            u0, u1, u2, u3, u4, u5, u6, u7 = n0, n1, n2, n3, n4, n5, n6, n7
    pdl_trigger_late(TRIGGER)
    dst = _addr(out_ptr + pid_k * stride_os + row0)
    if SPLIT > 1:
        tl.inline_asm_elementwise(_STORE_F32, "=r,f,f,l,l", [c0 + c2, c1 + c3, dst, dst], dtype=tl.int32,
                                  is_pure=False, pack=1)
    elif HAS_BIAS:
        tl.inline_asm_elementwise(_STORE_F16_BIAS, "=r,f,f,l,l", [c0 + c2, c1 + c3, dst, _addr(b_ptr + row0)],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(_STORE_F16, "=r,f,f,l,l", [c0 + c2, c1 + c3, dst, dst], dtype=tl.int32,
                                  is_pure=False, pack=1)


@dataclass(frozen=True)
class MmaGemvConfig:
    """One launch of the tensor-core GEMV: ``warps`` blocks of 16 rows a program (one a warp), K split over
    ``split_k`` programs, the next group's codes loaded before this group's products (``prefetch``)."""
    warps: int = 4
    split_k: int = 1
    prefetch: bool = True

    def __post_init__(self) -> None:
        check_tiles(self, ("warps",))


_PACK_CODES = 2**24  # codes ``pack_mma`` converts at a time


def supports_mma(pw: PackedWeight) -> bool:
    """True when ``pack_mma`` can lay out ``pw`` for the tensor-core GEMV (see the requirements above)."""
    n, k = pw.out_features, pw.in_features
    return (pw.bits == 4 and pw.scales.dtype == torch.float16 and n % 16 == 0 and k % 128 == 0
            and (pw.group_size % 128 == 0 or pw.group_size == k)
            and (pw.mins is None or pw.mins.dtype == torch.float16))


def pack_mma(pw: PackedWeight) -> torch.Tensor:
    """The codes of a 4-bit ``pw`` in the mma fragment order (see above): int32 words [N / 16, 2 K], block b's group
    kg at words 256 kg .. 256 kg + 255, its half h at + 128 h, thread l's four k-steps at + 4 l."""
    if not supports_mma(pw):
        raise ValueError(f"pack_mma: needs 4-bit codes, float16 scales, N % 16 == 0, K % 128 == 0 and groups of a "
                         f"multiple of 128 columns (bits={pw.bits}, {pw.out_features} x {pw.in_features}, "
                         f"group_size={pw.group_size}, scales {pw.scales.dtype})")
    n, k = pw.out_features, pw.in_features
    out = torch.empty(n // 16, 2 * k, dtype=torch.int32, device=pw.qweight.device)
    step = max(16, (_PACK_CODES // k) // 16 * 16)  # rows at a time: int64 temporaries of about 128 MiB
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        q = unpack_int4(pw.qweight[r0:r1]).to(torch.int64)
        # Rows 16 b + 8 hi + g; columns 128 kg + 32 t + 16 h + 8 half + 2 j + e: k-step 4 h + j of group kg.
        v = q.view((r1 - r0) // 16, 2, 8, k // 128, 4, 2, 2, 4, 2)  # [b, hi, g, kg, t, h, half, j, e]
        v = v.permute(0, 3, 5, 2, 4, 7, 8, 6, 1)  # [b, kg, h, g, t, j, e, half, hi]: nibble 4 e + 2 half + hi
        v = v.reshape((r1 - r0) // 16, k // 128, 2, 32, 4, 8)
        word = (v << torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)).sum(-1)  # [b, kg, h, lane, j]
        word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
        out[r0 // 16:r1 // 16] = word.view((r1 - r0) // 16, 2 * k)
    return out


def mma_enabled() -> bool:
    """``ROOFLM_QUANT_MMA`` (default 0): 1 gives 4-bit float16 weights on CUDA the tensor-core layout (a second copy
    of the codes) and with it the tensor-core GEMV as a candidate of ``quant_gemv.pick_gemv``; 0 keeps the word GEMV
    alone and the codes in one copy."""
    value = os.environ.get("ROOFLM_QUANT_MMA", "0")
    if value not in ("0", "1"):
        raise ValueError(f"ROOFLM_QUANT_MMA must be 0 or 1; got {value!r}")
    return value == "1"


def with_mma(pw: PackedWeight) -> PackedWeight:
    """``pw`` with ``mma`` set (``pack_mma``) where the tensor-core GEMV can take it: on CUDA, 4 bits, float16,
    the shapes of ``supports_mma``, and ``mma_enabled()``; ``pw`` unchanged elsewhere."""
    if pw.mma is not None or not pw.qweight.is_cuda or not supports_mma(pw) or not mma_enabled():
        return pw
    return replace(pw, mma=pack_mma(pw))


def unpack_mma(words: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The [n, k] codes (int64, 0..15) that ``words`` (``pack_mma``'s output) hold, read back through the mma's
    fragment order (the reference the layout is tested against): nibble i of thread l's word for k-step 4 h + j of
    group kg in block b is W[16 b + l // 4 + 8 (i % 2), 128 kg + 32 (l % 4) + 16 h + 8 (i // 2 % 2) + 2 j + i // 4]."""
    w = words.view(n // 16, k // 128, 2, 32, 4).to(torch.int64) & 0xFFFFFFFF  # [b, kg, h, lane, j]
    nib = (w[..., None] >> torch.arange(0, 32, 4, device=words.device)) & 0xF  # [b, kg, h, lane, j, i]
    nib = nib.view(n // 16, k // 128, 2, 8, 4, 4, 2, 2, 2)  # [b, kg, h, g, t, j, e, half, hi]
    return nib.permute(0, 8, 3, 1, 4, 2, 7, 5, 6).reshape(n, k)  # rows (b, hi, g), columns (kg, t, h, half, j, e)


@functools.lru_cache(maxsize=None)
def default_mma_config(n: int, k: int) -> MmaGemvConfig:
    """Four blocks of 16 rows a program (a warp each), the next group's codes loaded ahead, and K split until the
    grid holds about 4,000 warps (31 a multiprocessor on 132): a warp's groups run one after another (its loads,
    then two chains of four dependent mmas), so the stream needs many warps. From an H100 over Llama-2-7B's
    projections, where the fastest splits were qkv 4, gate_up 8, o and down 16 (this rule gives 5, 3, 16, 16;
    ``mma_candidates`` also times twice and half the split)."""
    blocks = n // 16
    split = max(1, min(k // 512, round(4096 / blocks)))
    return MmaGemvConfig(4, split, True)


def mma_candidates(x: torch.Tensor, pw: PackedWeight) -> list[MmaGemvConfig]:
    """The tensor-core GEMV's configurations ``quant_gemv.pick_gemv`` times beside the word GEMV's, where ``pw.mma``
    is set and x is one float16 row on CUDA; none elsewhere."""
    if pw.mma is None or x.dtype != torch.float16 or not x.is_cuda or x.shape[0] != 1:
        return []
    base = default_mma_config(pw.out_features, pw.in_features)
    cands = [base, replace(base, split_k=base.split_k * 2), replace(base, split_k=max(1, base.split_k // 2))]
    return [c for c in dict.fromkeys(cands) if (pw.out_features // 16) % c.warps == 0]


def launch_mma_gemv(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None,
                    cfg: MmaGemvConfig | None = None, pdl_trigger: int = 0, pdl_wait: bool = False,
                    epilogues: tuple = (False, None, None)) -> torch.Tensor:
    """out [1, N] = x [1, K] (float16, contiguous, already gathered by ``pw.perm``) @ dequantize(pw).T (+ bias),
    from ``pw.mma`` (``with_mma``). ``pdl_*``: as in ``rooflm.kernels.gemv.launch_gemv``. ``epilogues``: the word
    GEMV's (silu_mul, add_sumsq, rstd_sumsq), which this kernel does not have: ValueError unless all are off."""
    n, k = pw.out_features, pw.in_features
    if pw.mma is None:
        raise ValueError("the tensor-core GEMV needs pw.mma (rooflm.kernels.quant_gemv_mma.with_mma)")
    if epilogues[0] or epilogues[1] is not None or epilogues[2] is not None:
        raise ValueError("the tensor-core GEMV has no SiLU-and-mul or norm handoff epilogue: use a word-GEMV "
                         "configuration (QuantGemvConfig) for those")
    if x.shape != (1, k) or x.dtype != torch.float16 or not x.is_contiguous():
        raise ValueError(f"the tensor-core GEMV needs one contiguous float16 row of {k} columns; got x "
                         f"{tuple(x.shape)} {x.dtype}")
    cfg = cfg or default_mma_config(n, k)
    if (n // 16) % cfg.warps:
        raise ValueError(f"{cfg}: {n // 16} blocks of 16 rows do not split into programs of {cfg.warps}")
    groups = k // 128
    per = triton.cdiv(groups, min(cfg.split_k, groups))
    split = triton.cdiv(groups, per)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    dst = out if split == 1 else torch.empty(split, 1, n, dtype=torch.float32, device=x.device)
    trigger, wait, pdl = pdl_launch(pdl_trigger, pdl_wait, x.device)
    mins = pw.mins if pw.mins is not None else pw.scales
    b = bias if bias is not None else pw.scales
    _w4_mma_gemv_kernel[(n // 16 // cfg.warps, split)](
        x.view(torch.int32), pw.mma, pw.scales.view(torch.int16), mins.view(torch.int16), b, dst, n, k, per,
        pw.scales.stride(0), n if split > 1 else 0, GSTEP=0 if pw.group_size == k else pw.group_size // 128,
        HAS_MIN=pw.mins is not None, HAS_BIAS=bias is not None, SPLIT=split, WARPS=cfg.warps,
        PREFETCH=cfg.prefetch, TRIGGER=trigger if split == 1 else 0, WAIT=wait, num_warps=cfg.warps, num_stages=1,
        **pdl)
    if split > 1:
        _splitk_reduce_kernel[(1, triton.cdiv(n, 1024))](dst, b, out, 1, n, out.stride(0), SPLIT=split,
                                                         HAS_BIAS=bias is not None, BLOCK=1024, num_warps=4,
                                                         TRIGGER=1 if trigger else 0)
    return out
