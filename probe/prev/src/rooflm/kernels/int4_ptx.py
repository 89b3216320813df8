# 4-bit weight codes to float16 with PTX, two codes per 32-bit instruction (CUDA only; Triton's CPU interpreter
# cannot run inline assembly, so callers use these only on a GPU and keep a float32 conversion elsewhere).
#
# The bytes b0..b3 of a 32-bit word are first permuted to b0 b2 b1 b3 (prmt), so that the word holds b0 and b1 in its
# two 16-bit halves and the same word shifted right by 8 holds b2 and b3. ``lop3`` ((a & mask) | magic in one
# instruction) then ORs a nibble into the mantissa of 1024.0 in each half: 0x6400 | q is the float16 1024 + q, exact,
# and one sub.f16x2 takes the 1024 off both halves at once. High nibbles are read in place (mask 0x00F000F0):
# 1024 + 16 q, which one fma.f16x2 by 1/16 and -64 turns into q. Eight codes cost one prmt, one shift, four lop3 and
# four f16x2 operations, against about three 32-bit operations per code for the float32 magic number of
# rooflm/kernels/quant_gemm.py (this is the conversion of FasterTransformer and Marlin; Kim et al. 2022, "Who Says
# Elephants Can't Run"). ``i4_to_f16_scaled`` also applies the group's scale and min in float16x2 (fma.rn.f16x2: one
# rounding, the precision of the float16 operand that tl.dot receives anyway).
#
# Element order: with pack=4 Triton hands the assembly four consecutive uint8 elements in one 32-bit register (element
# j in byte j) and takes each float16 output as two 32-bit registers (elements 0, 1 and 2, 3, low half first).
import triton
import triton.language as tl

_I4_F16_HEAD = """
{
.reg .b32 t, t2, z, c, d;
mov.b32 z, 0;
prmt.b32 t, $4, z, 0x3120;
shr.b32 t2, t, 8;
lop3.b32 $0, t, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 $1, t2, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 $2, t, 0x00F000F0, 0x64006400, 0xEA;
lop3.b32 $3, t2, 0x00F000F0, 0x64006400, 0xEA;
mov.b32 c, 0x64006400;
sub.f16x2 $0, $0, c;
sub.f16x2 $1, $1, c;
mov.b32 c, 0x2C002C00;
mov.b32 d, 0xD400D400;
fma.rn.f16x2 $2, $2, c, d;
fma.rn.f16x2 $3, $3, c, d;
"""


# Triton reads globals inside a kernel only as constexpr.
_I4_F16_ASM = tl.constexpr(_I4_F16_HEAD + "}")
_I4_F16_SCALED_ASM = tl.constexpr(_I4_F16_HEAD + """fma.rn.f16x2 $0, $0, $5, $7;
fma.rn.f16x2 $1, $1, $6, $8;
fma.rn.f16x2 $2, $2, $5, $7;
fma.rn.f16x2 $3, $3, $6, $8;
}""")


@triton.jit
def i4_to_f16(q):
    """uint8 [.., W] -> (low nibbles, high nibbles) as float16 [.., W], exact."""
    return tl.inline_asm_elementwise(_I4_F16_ASM, "=r,=r,=r,=r,r", [q], dtype=(tl.float16, tl.float16),
                                     is_pure=True, pack=4)


@triton.jit
def i4_to_f16_scaled(q, s, m):
    """uint8 [.., W], float16 scales and mins broadcast to [.., W] -> (lo * s + m, hi * s + m) in float16."""
    return tl.inline_asm_elementwise(_I4_F16_SCALED_ASM, "=r,=r,=r,=r,r,r,r,r,r", [q, s, m],
                                     dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
