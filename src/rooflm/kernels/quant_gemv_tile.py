# One tile of the word GEMV (rooflm/kernels/quant_gemv.py): its loads (the codes as 32-bit words, the x pairs, the
# groups' scales and mins) and its products, in float16x2 PTX (rooflm/kernels/quant_gemv_ptx.py) or in the float32
# form. Kept apart from the kernel's loops so that a loop can issue a tile's loads before the previous tile's
# products (``prefetch``): under Nsight Compute on an H100, a scale load issued and used in the same tile was the
# 4-bit GEMV's longest single wait (14% of its warps' stall samples, 7% more on the x pairs).
from __future__ import annotations

import triton
import triton.language as tl

from rooflm.kernels.quant_gemv_ptx import _halves, _w4_f16x2, _w8_f16x2


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
def _params(s_ptr, m_ptr, offs_n, mask_n, offs_g, k0, k_hi, GROUP, stride_sn, HAS_MIN: tl.constexpr,
            EVEN_N: tl.constexpr, MASK_K: tl.constexpr):
    """The scales and mins (the scales again where there are none) of the groups of the tile after column k0."""
    g = k0 // GROUP + offs_g
    g_end = tl.cdiv(k_hi, GROUP)
    sc = _group_params(s_ptr, offs_n, mask_n, stride_sn, g, g_end, EVEN_N, not MASK_K)
    mn = sc
    if HAS_MIN:
        mn = _group_params(m_ptr, offs_n, mask_n, stride_sn, g, g_end, EVEN_N, not MASK_K)
    return sc, mn


@triton.jit
def _xw(xw_ptr, wtile, k0, k_hi, BITS: tl.constexpr, MASK_K: tl.constexpr, ASM: tl.constexpr):
    """The float16 x pairs (as int32 words) that the tile's words meet in the float16x2 form: four a word at 4 bits,
    two at 8 (the last two returned are then the first two again, unused); with ASM off, placeholders (x is then
    read as floats by ``_products``)."""
    if ASM:
        PAIRS: tl.constexpr = 4 if BITS == 4 else 2
        cols = k0 // (32 // BITS) + wtile
        xp = xw_ptr + cols * PAIRS
        if MASK_K:
            live = cols * (32 // BITS) < k_hi
            p0 = tl.load(xp, mask=live, other=0)
            p1 = tl.load(xp + 1, mask=live, other=0)
            if BITS == 4:
                p2 = tl.load(xp + 2, mask=live, other=0)
                p3 = tl.load(xp + 3, mask=live, other=0)
            else:
                p2 = p0
                p3 = p1
        else:
            p0 = tl.load(xp)
            p1 = tl.load(xp + 1)
            if BITS == 4:
                p2 = tl.load(xp + 2)
                p3 = tl.load(xp + 3)
            else:
                p2 = p0
                p3 = p1
    else:
        p0 = 0
        p1 = 0
        p2 = 0
        p3 = 0
    return p0, p1, p2, p3


@triton.jit
def _rows(pid_n, N, BLOCK_N: tl.constexpr, SILU_MUL: tl.constexpr, SECTORS: tl.constexpr = 1):
    """The rows of W that program ``pid_n`` holds, and which of them lie inside W: one a row slot, or SECTORS
    consecutive entries a slot (one a 32-byte sector of the slot's tile, for ``_l2_ahead``). With SILU_MUL W is
    [gate | up], N = 2 * intermediate, and the slots interleave gate row j and up row N / 2 + j."""
    if SILU_MUL:
        r = tl.arange(0, BLOCK_N * SECTORS) // SECTORS
        j = pid_n * (BLOCK_N // 2) + r // 2
        return j + (r % 2) * (N // 2), j < N // 2
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N * SECTORS) // SECTORS
    return rows, rows < N


@triton.jit
def _l2_ahead(q_ptr, pid_n, N, stride_qn, k0, last, PER: tl.constexpr, WORDS: tl.constexpr, BLOCK_N: tl.constexpr,
              SILU_MUL: tl.constexpr):
    """Asks the L2 for the words of the tile after column min(k0, last) of program ``pid_n``'s rows (as the kernel
    numbers them; rows past N ask for row N - 1): PTX ``prefetch.global.L2``, one request a 32-byte sector, each from
    one thread, no register written and nothing waited for, so more of the stream is in flight than the registers
    hold. A hint: the bits computed do not depend on it."""
    SECTORS: tl.constexpr = (WORDS + 7) // 8
    # one flat index over (row slot, sector), so that no two threads hold the same sector
    row, _ = _rows(pid_n, N, BLOCK_N, SILU_MUL, SECTORS)
    col = tl.minimum(k0, last) // PER + (tl.arange(0, BLOCK_N * SECTORS) % SECTORS) * 8
    addr = (q_ptr + tl.minimum(row, N - 1).to(tl.int64) * stride_qn + col).to(tl.int64, bitcast=True)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [addr], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _l2_first(q_ptr, pid_n, N, stride_qn, k_lo, last, PER: tl.constexpr, WORDS: tl.constexpr,
              BLOCK_N: tl.constexpr, SILU_MUL: tl.constexpr, AHEAD: tl.constexpr):
    """Before the loop: the L2 asked for the tiles 1 .. AHEAD - 1 after column k_lo (the loop asks for the one AHEAD
    ahead of each tile it multiplies)."""
    TILE: tl.constexpr = WORDS * PER
    for d in tl.static_range(1, AHEAD):
        _l2_ahead(q_ptr, pid_n, N, stride_qn, k_lo + d * TILE, last, PER, WORDS, BLOCK_N, SILU_MUL)


@triton.jit
def _accumulate(acc, p, xs, sc, mn, BITS: tl.constexpr, HAS_MIN: tl.constexpr, ASM: tl.constexpr,
                PAIR: tl.constexpr):
    """acc + a tile's partial products ``p`` times their groups' scales, + the groups' mins times the x sums."""
    if ASM:  # the products were formed with x / 16 (4 bits, see _W4_DOT8_ASM) or x / 128 (8 bits, _W8_DOT4_ASM)
        sc = sc * (128.0 if BITS == 8 else 32.0 if PAIR else 16.0)
    acc += p * sc[:, :, None]
    if HAS_MIN:
        acc += mn[:, :, None] * xs[None]
    return acc


@triton.jit
def _accumulate_late(acc, p, xs, s_ptr, m_ptr, offs_n, mask_n, offs_g, k0, k_hi, GROUP, stride_sn,
                     BITS: tl.constexpr, HAS_MIN: tl.constexpr, EVEN_N: tl.constexpr, MASK_K: tl.constexpr,
                     ASM: tl.constexpr, PAIR: tl.constexpr):
    """``_accumulate`` for a loop that does not prefetch: the scales loaded after the products and the mins after
    the scaled products, the order that measured fastest there (on an H100, loading both before the products cost
    6-18%)."""
    g = k0 // GROUP + offs_g
    g_end = tl.cdiv(k_hi, GROUP)
    sc = _group_params(s_ptr, offs_n, mask_n, stride_sn, g, g_end, EVEN_N, not MASK_K)
    acc = _accumulate(acc, p, xs, sc, sc, BITS, False, ASM, PAIR)
    if HAS_MIN:
        acc += _group_params(m_ptr, offs_n, mask_n, stride_sn, g, g_end, EVEN_N, not MASK_K)[:, :, None] * xs[None]
    return acc


@triton.jit
def _products(u, xq, x_ptr, wtile, k0, k_hi,
              BITS: tl.constexpr, HAS_MIN: tl.constexpr, MASK_K: tl.constexpr, ASM: tl.constexpr,
              PAIR: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, GROUP_WORDS: tl.constexpr):
    """One tile's partial products (a float32 a word, or a pair of words with PAIR) and x sums (for the mins): the
    codes ``u`` (``_words``) of the words ``wtile`` after column k0 against the x pairs ``xq`` (``_xw``), or
    against x itself read as floats (no ASM)."""
    p0, p1, p2, p3 = xq
    PER: tl.constexpr = 32 // BITS  # codes per word
    EVEN: tl.constexpr = not MASK_K
    cols = k0 // PER + wtile  # word index along the row
    if BITS == 4 and ASM:
        p, xs = _w4_f16x2(u, p0, p1, p2, p3, PAIR, BLOCK_N, GROUPS, GROUP_WORDS)
    elif ASM:  # 8 bits
        p = _w8_f16x2(u, p0, p1, PAIR, BLOCK_N, GROUPS, GROUP_WORDS)
        if HAS_MIN:
            xs = (_xcol(x_ptr, cols, 0, PER, 1.0, EVEN, k_hi) + _xcol(x_ptr, cols, 1, PER, 1.0, EVEN, k_hi)
                  + _xcol(x_ptr, cols, 2, PER, 1.0, EVEN, k_hi) + _xcol(x_ptr, cols, 3, PER, 1.0, EVEN, k_hi))
            if PAIR:
                xs0, xs1 = _halves(xs, (GROUPS, GROUP_WORDS // 2))
                xs = xs0 + xs1
        else:
            xs = 0.0  # unused
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
    return p, xs
