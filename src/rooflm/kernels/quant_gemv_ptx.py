# The word GEMV's products in float16x2 PTX (CUDA, float16 activations): the inner loops of
# rooflm/kernels/quant_gemv.py for 4- and 8-bit codes, kept apart from the kernel's tiling and launch logic.
#
# Technique: the codes of a 32-bit word become float16 pairs without a shift or an integer-to-float conversion, by
# writing them under the exponent bits of 1024.0 (lop3 for nibbles, prmt for bytes) and subtracting 1024 in float16x2,
# as in FasterTransformer and Marlin (Frantar et al. 2024; Kim et al. 2022, "Who Says Elephants Can't Run"); the
# products with x are float16x2 fused multiply-adds, two codes an instruction, and a word (or a pair of words) leaves
# as one float32 partial sum to which the caller applies the group's scale and min.
from __future__ import annotations

import triton
import triton.language as tl


# Four codes' worth of float16x2 arithmetic per instruction (CUDA, float16 x): the 4-bit codes of a word become
# float16 pairs as in rooflm/kernels/int4_ptx.py (prmt, lop3 into the mantissa of 1024, sub.f16x2: exact), meet x in
# four fma.f16x2 and leave as one float32 (the two halves converted and added). The x pairs are arranged once per tile
# for every row of the program (_X_PAIRS_ASM): the word's nibble pairs are (0, 2), (4, 6), (1, 3), (5, 7) in the
# column order of the packed layout, x / 16 for low nibbles and x / 256 for high ones (read in place as 16 q), so a
# product is q x / 16 and four of them stay below 4 |x|: no float16 overflow below |x| = 16,000. The group's scale
# times 16 restores the magnitude. Each product is rounded to float16 (relative 2**-11, the rounding a float16
# dequantized weight has anyway) and a half sums four of them before the float32 accumulation; 17 instructions a
# word against about 50 in the float32 form of rooflm/kernels/quant_gemv.py.
def _dot_ptx(bits: int, words: int) -> str:
    """PTX of ``words`` words of ``bits``-bit codes ($1.. $words) against their x pairs (four float16x2 registers a
    word at 4 bits, two at 8, after the words), summed into one float16x2 register and left as one float32 ($0)."""
    if bits == 4:
        regs, consts, codes = "t, t2, z, c, l0, l1, h0, h1, a", ["mov.b32 z, 0;", "mov.b32 c, 0x64006400;"], \
            ["l0", "l1", "h0", "h1"]
    else:
        regs, consts, codes = "t, c, k, l0, h0, a", ["mov.b32 c, 0x64646464;", "mov.b32 k, 0x64806480;"], ["l0", "h0"]
    lines = ["{", f".reg .b32 {regs};", ".reg .f16 lo, hi;", ".reg .f32 f0, f1;"] + consts
    for w in range(words):
        lines += _codes_4bit(f"${1 + w}") if bits == 4 else _codes_8bit(f"${1 + w}")
        for i, r in enumerate(codes):
            x = f"${1 + words + len(codes) * w + i}"
            lines.append(f"mul.rn.f16x2 a, {r}, {x};" if w == i == 0 else f"fma.rn.f16x2 a, {r}, {x}, a;")
    return "\n".join(lines + _F16X2_TO_F32 + ["}"])


def _codes_4bit(word: str) -> list[str]:
    """A word's eight nibbles as float16 pairs l0, l1, h0, h1 (16 q for the high nibbles, read in place)."""
    return [f"prmt.b32 t, {word}, z, 0x3120;", "shr.b32 t2, t, 8;",
            "lop3.b32 l0, t, 0x000F000F, 0x64006400, 0xEA;", "lop3.b32 l1, t2, 0x000F000F, 0x64006400, 0xEA;",
            "lop3.b32 h0, t, 0x00F000F0, 0x64006400, 0xEA;", "lop3.b32 h1, t2, 0x00F000F0, 0x64006400, 0xEA;",
            "sub.f16x2 l0, l0, c;", "sub.f16x2 l1, l1, c;", "sub.f16x2 h0, h0, c;", "sub.f16x2 h1, h1, c;"]


def _codes_8bit(word: str) -> list[str]:
    """A word's four signed bytes as float16 pairs l0 (bytes 0, 1) and h0 (bytes 2, 3)."""
    return [f"xor.b32 t, {word}, 0x80808080;", "prmt.b32 l0, t, c, 0x4140;", "prmt.b32 h0, t, c, 0x4342;",
            "sub.f16x2 l0, l0, k;", "sub.f16x2 h0, h0, k;"]


# The float16x2 sum ``a`` leaves as one float32: both halves converted and added.
_F16X2_TO_F32 = ["mov.b32 {lo, hi}, a;", "cvt.f32.f16 f0, lo;", "cvt.f32.f16 f1, hi;", "add.f32 f0, f0, f1;",
                 "mov.b32 $0, f0;"]
_W4_DOT8_ASM = tl.constexpr(_dot_ptx(4, 1))
# Two words a call (``pair``): the eight products of the second word join the same float16x2 sum before the single
# conversion to float32 and the single scale FFMA, which saves about two instructions a word. A half then sums eight
# products, so x is divided by 32 and 512 instead (_X_PAIRS_ASM_HALVED): a product stays below |x| / 2 and eight of
# them below 16,000 up to |x| = 17,000, as four did before.
_W4_DOT16_ASM = tl.constexpr(_dot_ptx(4, 2))
# x of one word as four float16x2 words (x0, x1), (x2, x3), (x4, x5), (x6, x7) in, the pairs the codes meet out
# (scaled as above), and the word's x sum in float32 (for the group's min).
_X_PAIRS_TEMPLATE = """
{{
.reg .b32 a, b, c, d, s;
.reg .f16 e0, e1, e2, e3, e4, e5, e6, e7;
.reg .f32 f0, f1, f2, f3, f4, f5, f6, f7;
prmt.b32 a, $5, $6, 0x5410;
prmt.b32 b, $7, $8, 0x5410;
prmt.b32 c, $5, $6, 0x7632;
prmt.b32 d, $7, $8, 0x7632;
mov.b32 s, {lo};
mul.rn.f16x2 a, a, s;
mul.rn.f16x2 b, b, s;
mov.b32 s, {hi};
mul.rn.f16x2 c, c, s;
mul.rn.f16x2 d, d, s;
mov.b32 {{e0, e1}}, $5;
mov.b32 {{e2, e3}}, $6;
mov.b32 {{e4, e5}}, $7;
mov.b32 {{e6, e7}}, $8;
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
}}
"""
_X_PAIRS_ASM = tl.constexpr(_X_PAIRS_TEMPLATE.format(lo="0x2C002C00", hi="0x1C001C00"))  # x / 16, x / 256
_X_PAIRS_ASM_HALVED = tl.constexpr(_X_PAIRS_TEMPLATE.format(lo="0x28002800", hi="0x18001800"))  # x / 32, x / 512


# The same for 8-bit codes (CUDA, float16 x): a signed byte q, XOR 0x80, is q + 128 in [0, 255]; prmt places two
# such bytes under the exponent byte of 1024 (0x64), so each float16 half reads 1024 + q + 128 exactly, and one
# sub.f16x2 of 1152 leaves q. The x pairs (x0, x1), (x2, x3) are x / 128 (exact: a power of two), so a product is
# q x / 128, at most |x|, and the two that a half sums stay finite below |x| = 32,000; the scale times 128 restores
# the magnitude. About 10 instructions a word of four codes, against about 24 in the float32 form of quant_gemv.py.
_W8_DOT4_ASM = tl.constexpr(_dot_ptx(8, 1))
_W8_DOT8_ASM = tl.constexpr(_dot_ptx(8, 2))  # ``pair``: a half sums four products, finite below |x| = 16,000
# x of one word as two float16x2 words (x0, x1), (x2, x3) in, the same divided by 128 out.
_X8_PAIRS_ASM = tl.constexpr("""
{
.reg .b32 s;
mov.b32 s, 0x20002000;
mul.rn.f16x2 $0, $2, s;
mul.rn.f16x2 $1, $3, s;
}
""")


@triton.jit
def _halves(v, SHAPE: tl.constexpr):
    """The even and odd words of ``v`` (last dimension split in two; SHAPE is v's shape with the last halved)."""
    return tl.split(tl.reshape(v, SHAPE + (2,)))


@triton.jit
def _w8_f16x2(u, p0, p1, PAIR: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
              GROUP_WORDS: tl.constexpr):
    """Partial products (float32, q x / 128 summed over each word, or each pair of words with PAIR) of a tile of
    8-bit words against their x pairs ``p0``, ``p1`` (``quant_gemv_tile._xw``; CUDA only)."""
    a, b = tl.inline_asm_elementwise(_X8_PAIRS_ASM, "=r,=r,r,r", [p0, p1], dtype=(tl.int32, tl.int32),
                                     is_pure=True, pack=1)
    if PAIR:
        H: tl.constexpr = GROUP_WORDS // 2
        shape: tl.constexpr = (BLOCK_N, GROUPS, H)
        u0, u1 = _halves(u, shape)
        a0, a1 = _halves(a, (GROUPS, H))
        b0, b1 = _halves(b, (GROUPS, H))
        p = tl.inline_asm_elementwise(_W8_DOT8_ASM, "=r,r,r,r,r,r,r",
                                      [u0, u1, tl.broadcast_to(a0[None], shape), tl.broadcast_to(b0[None], shape),
                                       tl.broadcast_to(a1[None], shape), tl.broadcast_to(b1[None], shape)],
                                      dtype=tl.float32, is_pure=True, pack=1)
    else:
        shape1: tl.constexpr = (BLOCK_N, GROUPS, GROUP_WORDS)
        p = tl.inline_asm_elementwise(_W8_DOT4_ASM, "=r,r,r,r",
                                      [u, tl.broadcast_to(a[None], shape1), tl.broadcast_to(b[None], shape1)],
                                      dtype=tl.float32, is_pure=True, pack=1)
    return p


@triton.jit
def _w4_f16x2(u, p0, p1, p2, p3, PAIR: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
              GROUP_WORDS: tl.constexpr):
    """Partial products (float32, q x / 16 summed over each word, or q x / 32 over each pair of words with PAIR)
    and x sums of a tile of 4-bit words against their x pairs ``p0``..``p3`` (``quant_gemv_tile._xw``; CUDA
    only)."""
    if PAIR:
        a, b, c, d, xs = tl.inline_asm_elementwise(_X_PAIRS_ASM_HALVED, "=r,=r,=r,=r,=r,r,r,r,r", [p0, p1, p2, p3],
                                                   dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.float32),
                                                   is_pure=True, pack=1)
        H: tl.constexpr = GROUP_WORDS // 2
        shape: tl.constexpr = (BLOCK_N, GROUPS, H)
        u0, u1 = _halves(u, shape)
        a0, a1 = _halves(a, (GROUPS, H))
        b0, b1 = _halves(b, (GROUPS, H))
        c0, c1 = _halves(c, (GROUPS, H))
        d0, d1 = _halves(d, (GROUPS, H))
        p = tl.inline_asm_elementwise(_W4_DOT16_ASM, "=r,r,r,r,r,r,r,r,r,r,r",
                                      [u0, u1, tl.broadcast_to(a0[None], shape), tl.broadcast_to(b0[None], shape),
                                       tl.broadcast_to(c0[None], shape), tl.broadcast_to(d0[None], shape),
                                       tl.broadcast_to(a1[None], shape), tl.broadcast_to(b1[None], shape),
                                       tl.broadcast_to(c1[None], shape), tl.broadcast_to(d1[None], shape)],
                                      dtype=tl.float32, is_pure=True, pack=1)
        xs0, xs1 = _halves(xs, (GROUPS, H))
        xs = xs0 + xs1
    else:
        a, b, c, d, xs = tl.inline_asm_elementwise(_X_PAIRS_ASM, "=r,=r,=r,=r,=r,r,r,r,r", [p0, p1, p2, p3],
                                                   dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.float32),
                                                   is_pure=True, pack=1)
        shape1: tl.constexpr = (BLOCK_N, GROUPS, GROUP_WORDS)
        p = tl.inline_asm_elementwise(_W4_DOT8_ASM, "=r,r,r,r,r,r",
                                      [u, tl.broadcast_to(a[None], shape1), tl.broadcast_to(b[None], shape1),
                                       tl.broadcast_to(c[None], shape1), tl.broadcast_to(d[None], shape1)],
                                      dtype=tl.float32, is_pure=True, pack=1)
    return p, xs
