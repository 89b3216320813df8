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
#   37-71% of the copy bandwidth on Llama-2-7B's projections, about 4 instructions a code executed. 8-bit codes
#   likewise (_W8_DOT4_ASM: a byte permute under the exponent of 1024, one float16x2 subtraction, two fused
#   multiply-adds: about 10 instructions a word against about 24): on an H200, 67-74% -> 82-88% of the read bandwidth
#   on Llama-2-7B's qkv and gate_up. ``pair`` sums two words in float16x2 before the one conversion and scale.
# * Elsewhere (float32 or bfloat16 x, and Triton's CPU interpreter, which cannot run PTX) a float32 form: a code
#   becomes a float *in place*, without a shift, by OR-ing the word, masked to the code's bits, into the mantissa of
#   2**23 and subtracting 2**23 (the "magic number" conversion; Kim et al. 2022, "Who Says Elephants Can't Run").
#   That yields code * 2**s for a code at bit s, exact while s + 4 <= 23; the 2**-s is folded into the x value the
#   code multiplies, scaled once per tile. Codes above bit 20 are shifted down once per word; signed 8-bit codes are
#   biased by 128 with one XOR per word and the bias is subtracted in the same FADD. Alone, this form was no faster
#   than the general kernel (38-46% at 4 bits): the instruction count, not the memory pattern, was the limit.
# * Loads ahead (``prefetch``, ``l2_ahead``): one program holds few tiles in flight (qkv's grid leaves an H100 about
#   twelve warps a multiprocessor, and Nsight Compute found them waiting on memory most), so a loop may load the words,
#   x pairs, scales and mins of the tile one or two ahead into registers before this tile's products, and ask the L2
#   for the tile further ahead, which costs no registers (quant_gemv_tile.py). The products and their order do not
#   change with either.
# * The group size and the row strides of the codes and scales are compile-time constants (one compile per row
#   length; a dense model has two, its hidden and intermediate sizes): a tile's rows are one base address plus
#   immediate offsets, and k // group is a shift. Compiled for sm_90 (Triton 3.9; tests/kernels/quant_gemv_sass.py),
#   the candidates execute 3-25% fewer instructions a tile (4 bits, 16 x 64 words on two warps: 440 -> 404; 8 bits,
#   16 x 128 on four: 310 -> 264), and tiles of many rows take far fewer registers (32 x 64 at 4 bits: 168 -> 96; each
#   row had held its own 64-bit pointer). The floating-point operations are the same ones.
#
# K may be split over SPLIT programs (more loads in flight when N is small): partial sums go to a float32 workspace
# that the split-K reduction of rooflm/kernels/gemv.py adds in a fixed order, so results do not depend on scheduling.
# Whole tiles load unmasked; a tile that runs past K is masked (codes, x, scales and mins), and only that one.
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from rooflm.kernels._tl import (add_sumsq_inputs, add_sumsq_store, gdc_wait, pdl_edges, pdl_launch, pdl_trigger_late,
                                rstd_of_partials, sumsq_partials)
from rooflm.kernels._utils import check_tiles, device_sms, interpreting, packed_copies  # noqa: F401 (this API)
from rooflm.kernels.gemv import _silu_mul_pairs, _splitk_reduce_kernel
from rooflm.kernels.quant_gemv_mma import MmaGemvConfig, launch_mma_gemv, mma_candidates
from rooflm.kernels.quant_gemv_tile import (_accumulate, _accumulate_late, _l2_ahead, _l2_first, _params, _products,
                                           _rows, _words, _xw)
from rooflm.quantization.packed import PackedWeight


@triton.jit
def _quant_gemv_kernel(
    x_ptr, xw_ptr, q_ptr, s_ptr, m_ptr, b_ptr, out_ptr,
    N, K, GROUP: tl.constexpr, k_per_split, stride_qn: tl.constexpr, stride_sn: tl.constexpr, stride_os,
    BITS: tl.constexpr, HAS_MIN: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
    GROUP_WORDS: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr, PAIR: tl.constexpr,
    SILU_MUL: tl.constexpr, r_ptr=None, nw_ptr=None, ro_ptr=None, ss_ptr=None, n_ss=1, eps=0.0,
    ADD_SUMSQ: tl.constexpr = False, RSTD: tl.constexpr = False, SS_BLOCK: tl.constexpr = 1,
    TRIGGER: tl.constexpr = 0, WAIT: tl.constexpr = False, PRELOAD: tl.constexpr = False, L2_AHEAD: tl.constexpr = 0,
):
    # A tile is [BLOCK_N rows, GROUPS groups, GROUP_WORDS words]: GROUPS > 1 only when a group is exactly
    # GROUP_WORDS words, so each (row, group) pair has one scale and min per tile. Whole tiles load unmasked; where
    # the tile does not divide K, the last one (from k_full on) is masked.
    PER: tl.constexpr = 32 // BITS  # codes per word
    TILE: tl.constexpr = GROUPS * GROUP_WORDS * PER  # columns of x per tile
    pdl_edges(TRIGGER, WAIT and not PRELOAD)  # programmatic dependent launch (see rooflm.kernels.gemv.launch_gemv)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n, mask_n = _rows(pid_n, N, BLOCK_N, SILU_MUL)
    offs_g = tl.arange(0, GROUPS)
    wtile = offs_g[:, None] * GROUP_WORDS + tl.arange(0, GROUP_WORDS)[None, :]  # [GROUPS, GROUP_WORDS]
    rows = q_ptr + offs_n.to(tl.int64)[:, None, None] * stride_qn
    acc = tl.zeros([BLOCK_N, GROUPS, GROUP_WORDS // 2 if PAIR else GROUP_WORDS], tl.float32)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    k_full = k_lo + (k_hi - k_lo) // TILE * TILE
    if PRELOAD:  # whole tiles: the first one's words (which no kernel writes) loaded before the wait
        u = _words(rows, mask_n, wtile, k_lo, k_hi, PER, EVEN_N, False)
        gdc_wait()
    epi_in = (r_ptr, nw_ptr)
    if ADD_SUMSQ and SPLIT == 1:  # loaded now, used after the main loop (see rooflm/kernels/_tl.py)
        epi_in = add_sumsq_inputs(r_ptr, nw_ptr, offs_n, mask_n)
    ss_parts = 0.0
    if RSTD:
        ss_parts = sumsq_partials(ss_ptr, n_ss, SS_BLOCK)
    if PREFETCH:  # the loads of the tile PREFETCH ahead (words, scales, mins, x pairs) come before this tile's products
        if not PRELOAD:
            u = _words(rows, mask_n, wtile, k_lo, k_hi, PER, EVEN_N, True)  # masked: K may hold no whole tile
        sc, mn = _params(s_ptr, m_ptr, offs_n, mask_n, offs_g, k_lo, k_hi, GROUP, stride_sn, HAS_MIN, EVEN_N, True)
        xq = _xw(xw_ptr, wtile, k_lo, k_hi, BITS, True, ASM)
        last = tl.maximum(k_full - TILE, k_lo)  # past it, the loads ahead repeat the last whole tile (unused)
        if L2_AHEAD:  # the L2 asked for the tiles up to L2_AHEAD ahead of the first, then one more each tile
            _l2_first(q_ptr, pid_n, N, stride_qn, k_lo, last, PER, GROUPS * GROUP_WORDS, BLOCK_N, SILU_MUL, L2_AHEAD)
        if PREFETCH == 2:  # two tiles ahead: the second one's loads
            k1 = tl.minimum(k_lo + TILE, last)
            u1 = _words(rows, mask_n, wtile, k1, k_hi, PER, EVEN_N, True)
            sc1, mn1 = _params(s_ptr, m_ptr, offs_n, mask_n, offs_g, k1, k_hi, GROUP, stride_sn, HAS_MIN, EVEN_N,
                               True)
            xq1 = _xw(xw_ptr, wtile, k1, k_hi, BITS, True, ASM)
        for k0 in range(k_lo, k_full, TILE):
            if L2_AHEAD:
                _l2_ahead(q_ptr, pid_n, N, stride_qn, k0 + L2_AHEAD * TILE, last, PER, GROUPS * GROUP_WORDS, BLOCK_N,
                          SILU_MUL)
            k_next = tl.minimum(k0 + PREFETCH * TILE, last)
            u_next = _words(rows, mask_n, wtile, k_next, k_hi, PER, EVEN_N, False)
            sc_next, mn_next = _params(s_ptr, m_ptr, offs_n, mask_n, offs_g, k_next, k_hi, GROUP, stride_sn,
                                       HAS_MIN, EVEN_N, False)
            xq_next = _xw(xw_ptr, wtile, k_next, k_hi, BITS, False, ASM)
            p, xs = _products(u, xq, x_ptr, wtile, k0, k_hi, BITS, HAS_MIN, False, ASM, PAIR, BLOCK_N, GROUPS,
                              GROUP_WORDS)
            acc = _accumulate(acc, p, xs, sc, mn, BITS, HAS_MIN, ASM, PAIR)
            if PREFETCH == 2:
                u = u1
                xq = xq1
                sc = sc1
                mn = mn1
                u1 = u_next
                xq1 = xq_next
                sc1 = sc_next
                mn1 = mn_next
            else:
                u = u_next
                xq = xq_next
                sc = sc_next
                mn = mn_next
    else:
        k_start = k_lo
        last = tl.maximum(k_full - TILE, k_lo)
        if L2_AHEAD:
            _l2_first(q_ptr, pid_n, N, stride_qn, k_lo, last, PER, GROUPS * GROUP_WORDS, BLOCK_N, SILU_MUL, L2_AHEAD)
        if PRELOAD:  # the first iteration, in its order
            p, xs = _products(u, _xw(xw_ptr, wtile, k_lo, k_hi, BITS, False, ASM), x_ptr, wtile, k_lo, k_hi, BITS,
                              HAS_MIN, False, ASM, PAIR, BLOCK_N, GROUPS, GROUP_WORDS)
            acc = _accumulate_late(acc, p, xs, s_ptr, m_ptr, offs_n, mask_n, offs_g, k_lo, k_hi, GROUP, stride_sn,
                                   BITS, HAS_MIN, EVEN_N, False, ASM, PAIR)
            k_start = k_lo + TILE
        for k0 in range(k_start, k_full, TILE):
            if L2_AHEAD:
                _l2_ahead(q_ptr, pid_n, N, stride_qn, k0 + L2_AHEAD * TILE, last, PER, GROUPS * GROUP_WORDS, BLOCK_N,
                          SILU_MUL)
            u = _words(rows, mask_n, wtile, k0, k_hi, PER, EVEN_N, False)
            p, xs = _products(u, _xw(xw_ptr, wtile, k0, k_hi, BITS, False, ASM), x_ptr, wtile, k0, k_hi, BITS,
                              HAS_MIN, False, ASM, PAIR, BLOCK_N, GROUPS, GROUP_WORDS)
            acc = _accumulate_late(acc, p, xs, s_ptr, m_ptr, offs_n, mask_n, offs_g, k0, k_hi, GROUP, stride_sn,
                                   BITS, HAS_MIN, EVEN_N, False, ASM, PAIR)
    if not EVEN_K:
        if k_full < k_hi:  # the tile that runs past K, masked, in the order of its loop
            u = _words(rows, mask_n, wtile, k_full, k_hi, PER, EVEN_N, True)
            if PREFETCH:
                sc, mn = _params(s_ptr, m_ptr, offs_n, mask_n, offs_g, k_full, k_hi, GROUP, stride_sn, HAS_MIN,
                                 EVEN_N, True)
            p, xs = _products(u, _xw(xw_ptr, wtile, k_full, k_hi, BITS, True, ASM), x_ptr, wtile, k_full, k_hi,
                              BITS, HAS_MIN, True, ASM, PAIR, BLOCK_N, GROUPS, GROUP_WORDS)
            if PREFETCH:
                acc = _accumulate(acc, p, xs, sc, mn, BITS, HAS_MIN, ASM, PAIR)
            else:
                acc = _accumulate_late(acc, p, xs, s_ptr, m_ptr, offs_n, mask_n, offs_g, k_full, k_hi, GROUP,
                                       stride_sn, BITS, HAS_MIN, EVEN_N, True, ASM, PAIR)
    pdl_trigger_late(TRIGGER)
    res = tl.sum(tl.sum(acc, 2), 1)
    if RSTD:  # the consumer of rooflm/kernels/handoff_gemv.py: x is h * norm_weight, the sums times 1/rms(h)
        res = res * rstd_of_partials(ss_parts, K, eps)
    if HAS_BIAS and SPLIT == 1:
        res += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if SILU_MUL:  # one K split: silu(gate) * up, rounded as the GEMV and then the activation kernel round it
        g, up = tl.split(tl.reshape(res, [BLOCK_N // 2, 2]))
        oc = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_ptr + oc, _silu_mul_pairs(g, up, out_ptr), mask=oc < N // 2)
    elif ADD_SUMSQ and SPLIT == 1:  # the producer of rooflm/kernels/handoff_gemv.py
        add_sumsq_store(out_ptr, res, offs_n, mask_n, pid_n, epi_in[0], epi_in[1], ro_ptr, ss_ptr)
    else:
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
    asm: bool = True  # float16 x on CUDA: products in float16x2 PTX (see _W4_DOT8_ASM and _W8_DOT4_ASM)
    prefetch: int = 0  # tiles loaded ahead: tile i + prefetch's words, x pairs, scales and mins before tile i's
    # products; 0, 1 or 2 (True is 1)
    pair: bool = False  # with asm: two words' products summed in float16x2 before one conversion (_W4_DOT16_ASM)
    l2_ahead: int = 0  # on CUDA: the L2 asked for the words of the tile this many ahead (0: not asked; _l2_ahead)

    def __post_init__(self) -> None:
        check_tiles(self, ("block_n", "words"))
        if self.prefetch not in (0, 1, 2):
            raise ValueError(f"prefetch={self.prefetch!r}: expected 0, 1 or 2 tiles ahead")
        if not 0 <= self.l2_ahead <= 8 or (self.l2_ahead and self.l2_ahead <= self.prefetch):
            raise ValueError(f"l2_ahead={self.l2_ahead!r}: expected 0, or more tiles ahead than prefetch="
                             f"{int(self.prefetch)} and at most 8")


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
# and the word GEMV 5-8% faster than the general kernel at 8 bits (then 20-25% more with its float16x2 form, and a
# few percent more on some shapes with ``pair``). ``ROOFLM_QUANT_GEMV=default`` keeps the static choice (the word
# GEMV with ``default_gemv_config`` at 4 bits, the general kernel at 8); ``ROOFLM_QUANT_GEMV=wide`` times every
# candidate at each prefetch depth (0, 1 and 2 tiles ahead), with and without L2 requests 4 tiles ahead: six times
# the timing at start-up, for cards and shapes the candidates were not swept on. The tensor-core GEMV joins where
# ``pw.mma``.
_gemv_picked: dict[tuple, "QuantGemvConfig | None"] = {}


def short_name(c: "QuantGemvConfig | None") -> str:
    """A configuration in a few characters, for reports: rows x words a tile, K splits, warps, one "p" a tile
    prefetched, "2" for two words a sum, "L4" for the L2 asked 4 tiles ahead; "general" for the general kernel."""
    if c is None:
        return "general"
    if isinstance(c, MmaGemvConfig):
        return f"mma/s{c.split_k}/{c.warps}w" + ("p" if c.prefetch else "")
    return (f"{c.block_n}x{c.words}w" + (f"/s{c.split_k}" if c.split_k > 1 else "") + f"/{c.num_warps}w"
            + "p" * int(c.prefetch) + ("2" if c.pair else "") + (f"L{c.l2_ahead}" if c.l2_ahead else ""))


def choices() -> dict[tuple, str]:
    """What ``pick_gemv`` picked so far, for reports: {(N, K, bits, group, ...): ``short_name`` of the pick}."""
    return {k: short_name(v) for k, v in _gemv_picked.items()}


def gemv_mode() -> str:
    """``ROOFLM_QUANT_GEMV``: ``auto`` (the default), ``default`` or ``wide`` (see above)."""
    mode = os.environ.get("ROOFLM_QUANT_GEMV", "auto")
    if mode not in ("auto", "default", "wide"):
        raise ValueError(f"ROOFLM_QUANT_GEMV={mode!r}: expected 'auto', 'default' or 'wide'")
    return mode


def gemv_candidates(n: int, k: int, bits: int, group_size: int, sms: int,
                    wide: bool | None = None) -> list["QuantGemvConfig | None"]:
    """What ``pick_gemv`` times for an [n, k] weight: configurations of the word GEMV whose tiles fit the groups,
    and None (the general kernel) at 8 bits. The static choice comes first. ``wide`` (by default where
    ``ROOFLM_QUANT_GEMV=wide``): each of them also 0, 1 and 2 tiles ahead (``prefetch``), each of those with and
    without the L2 asked for the tile 4 ahead (``l2_ahead``)."""
    split = triton.cdiv(n, 16) < 2 * sms  # few rows: K splits keep more loads in flight
    if bits == 4:
        out: list[QuantGemvConfig | None] = [default_gemv_config(n, k, bits, group_size, sms),
                                              QuantGemvConfig(16, 64, 1, 2, 3, prefetch=True),
                                              QuantGemvConfig(32, 64, 1, 2, 3),
                                              QuantGemvConfig(32, 64, 1, 2, 3, pair=True),
                                              QuantGemvConfig(32, 128, 1, 4, 3, pair=True),
                                              # the pairs' tiles one tile ahead: o's and down's picks on an H100
                                              QuantGemvConfig(32, 128, 1, 4, 3, prefetch=1, pair=True)]
        if split:
            out += [QuantGemvConfig(16, 64, 4, 2, 3, prefetch=True), QuantGemvConfig(32, 64, 4, 4, 3, pair=True),
                    QuantGemvConfig(32, 64, 4, 4, 3, prefetch=1, pair=True)]
    else:  # two tiles ahead: o (4096 x 4096) 9.2 against 9.8-10.0 us, down (4096 x 11008, with the L2 asked four
        # ahead) 19.3 against 19.7-19.9 us, on an H100 (tests/gpu/quant_gemv_sweep.py --grid depths)
        out = [None, QuantGemvConfig(8, 128, 1, 2, 3), QuantGemvConfig(16, 128, 1, 4, 3),
               QuantGemvConfig(16, 128, 1, 4, 3, pair=True), QuantGemvConfig(8, 128, 1, 2, 3, prefetch=2),
               QuantGemvConfig(16, 128, 1, 4, 3, prefetch=2, l2_ahead=4)]
        if split:
            out += [QuantGemvConfig(16, 128, 4, 2, 3), QuantGemvConfig(32, 128, 4, 4, 3),
                    QuantGemvConfig(32, 128, 4, 4, 3, pair=True)]
    if gemv_mode() == "wide" if wide is None else wide:
        out = list(dict.fromkeys(c if c is None else replace(c, prefetch=d, l2_ahead=a) for c in out
                                 for d in (0, 1, 2) for a in (0, 4)))
    return [c for c in out if c is None or tile_groups(c.words, k, bits, group_size) is not None]


def pick_gemv(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None):
    """The configuration ``quant_linear`` runs one row of x with: the word GEMV's, the tensor-core GEMV's
    (``MmaGemvConfig``, where ``pw.mma`` is set) or None for the general kernel (``supports(x, pw)`` must hold).
    Timed once per shape on CUDA (see above); elsewhere, inside a CUDA-graph capture, and with
    ``ROOFLM_QUANT_GEMV=default`` the static choice."""
    N, K = pw.out_features, pw.in_features
    key = (N, K, pw.bits, pw.group_size, pw.mins is not None, pw.mma is not None, bias is not None, x.dtype, x.device)
    if key in _gemv_picked:
        return _gemv_picked[key]
    cands = gemv_candidates(N, K, pw.bits, pw.group_size, device_sms(x)) + mma_candidates(x, pw)
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    mode = gemv_mode()
    if not x.is_cuda or interpreting() or capturing or mode == "default" or len(cands) == 1:
        pick = cands[0]
    else:
        from rooflm.kernels.gemv import time_in_graph

        pick = fastest(x, pw, bias, cands, time_in_graph)
    if not capturing:
        _gemv_picked[key] = pick
    return pick


# SiLU-and-mul as the epilogue of gate_up's word GEMV (as ``rooflm.kernels.fused_gemv.gemv_silu_mul`` does for
# float weights): a program takes rows j of gate and j of up, so it holds both sums of an output column and stores
# silu(gate) * up; the activation's launch and the [1, 2 x intermediate] round trip disappear, the bytes streamed
# stay the same. Equal, bit for bit, to the same configuration's GEMV followed by the activation kernel.
_silu_picked: dict[tuple, "QuantGemvConfig | None"] = {}


def pick_gemv_silu_mul(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None) -> "QuantGemvConfig | None":
    """The configuration to run ``gemv_silu_mul`` with for one row x and a [gate | up] packed weight, or None where
    the GEMV followed by the activation kernel was faster or the shapes do not suit the word GEMV. Timed once per
    shape on CUDA, outside CUDA-graph capture, against that unfused pair (``pick_gemv``'s choice then the activation
    kernel); None elsewhere, inside a capture of an unseen shape, and with ``ROOFLM_QUANT_GEMV=default``."""
    N, K = pw.out_features, pw.in_features
    if N % 2 or not supports(x, pw):
        return None
    key = (N, K, pw.bits, pw.group_size, pw.mins is not None, bias is not None, x.dtype, x.device)
    if key in _silu_picked:
        return _silu_picked[key]
    if (not x.is_cuda or interpreting() or torch.cuda.is_current_stream_capturing()
            or gemv_mode() == "default"):
        return None
    from rooflm.kernels.activation import silu_and_mul
    from rooflm.kernels.gemv import time_in_graph
    from rooflm.kernels.quant_gemm import launch, pick_config

    plain = pick_gemv(x, pw, bias)
    cands = [c for c in gemv_candidates(N, K, pw.bits, pw.group_size, device_sms(x))
             if c is not None and c.split_k == 1 and c.block_n >= 2]
    copies = packed_copies(pw)
    xs = torch.randn_like(x)
    general = pick_config(xs, pw, bias)

    def unfused(w: PackedWeight) -> torch.Tensor:
        return silu_and_mul(launch_gemv(xs, w, bias, plain) if plain is not None else launch(xs, w, bias, general))

    best: tuple[float, QuantGemvConfig | None] = (time_in_graph(unfused, copies, x.device), None)
    for c in cands:
        t = time_in_graph(lambda w, c=c: launch_gemv(xs, w, bias, c, silu_mul=True), copies, x.device)
        if t < best[0]:
            best = (t, c)
    _silu_picked[key] = best[1]
    return best[1]


def gemv_silu_mul(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None,
                  cfg: QuantGemvConfig) -> torch.Tensor:
    """silu(gate) * up of x @ W.T (+ bias) for one row x [1, K] and a [gate | up] packed W, in one launch."""
    if pw.perm is not None:
        x = x.index_select(1, pw.perm)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return launch_gemv(x, pw, bias, cfg, silu_mul=True)


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
                cfg: QuantGemvConfig | None = None, silu_mul: bool = False, add_sumsq: tuple | None = None,
                rstd_sumsq: torch.Tensor | None = None, eps: float = 0.0, pdl_trigger: int = 0,
                pdl_wait: bool = False, pdl_preload: bool = False) -> torch.Tensor:
    """out [1, N] = x [1, K] @ dequantize(pw).T (+ bias); x already gathered by ``pw.perm``, contiguous. With
    ``silu_mul`` (W is [gate | up]): silu(gate) * up [1, N / 2] in the roundings of the GEMV followed by
    ``rooflm.kernels.activation.silu_and_mul``, in one launch (K is not split then). The two halves of
    ``rooflm/kernels/handoff_gemv.py``: ``add_sumsq`` = (residual, norm_weight, h, sumsq) makes out h * norm_weight
    with h = out + residual written to h and sum(h^2) per ``cfg.block_n`` rows to sumsq; ``rstd_sumsq`` (partial
    sums of squares of the row x was made from) scales the sums by 1/rms. ``pdl_*``: as in ``gemv.launch_gemv``
    (the first tile preloaded where K is whole tiles)."""
    if isinstance(cfg, MmaGemvConfig):  # the tensor-core GEMV (rooflm/kernels/quant_gemv_mma.py): plain launches
        return launch_mma_gemv(x, pw, bias, cfg, pdl_trigger, pdl_wait, (silu_mul, add_sumsq, rstd_sumsq))
    N, K = pw.out_features, pw.in_features
    if silu_mul and (N % 2 or cfg is None or cfg.block_n < 2):
        raise ValueError(f"silu_mul needs an even number of rows ([gate | up]; got {N}) and a configuration of at "
                         f"least two rows a program (got {cfg})")
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
    split = 1 if silu_mul else max(1, min(cfg.split_k, tiles))
    k_per_split = triton.cdiv(tiles, split) * tile
    split = triton.cdiv(K, k_per_split)
    out = torch.empty(1, N // 2 if silu_mul else N, dtype=x.dtype, device=x.device)
    dst = out if split == 1 else torch.empty(split, 1, N, dtype=torch.float32, device=x.device)
    b = bias if bias is not None else pw.scales
    asm = (cfg.asm and x.dtype == torch.float16 and x.is_cuda and not interpreting()
           and x.data_ptr() % 4 == 0)
    xw = x.view(torch.int32) if asm else x
    r, nw, h, ss = add_sumsq if add_sumsq is not None else (None,) * 4
    ss = rstd_sumsq if rstd_sumsq is not None else ss
    hand = dict(r_ptr=r, nw_ptr=nw, ro_ptr=h, ss_ptr=ss, ADD_SUMSQ=add_sumsq is not None)
    trigger, wait, pdl = pdl_launch(pdl_trigger, pdl_wait, x.device)
    _quant_gemv_kernel[(triton.cdiv(N, cfg.block_n), split)](
        x, xw, words, pw.scales, pw.mins if pw.mins is not None else pw.scales, b, dst,
        N, K, pw.group_size, k_per_split, words.stride(0), pw.scales.stride(0), N if split > 1 else 0,
        BITS=pw.bits, HAS_MIN=pw.mins is not None, HAS_BIAS=bias is not None, SPLIT=split,
        EVEN_N=(N // 2) % (cfg.block_n // 2) == 0 if silu_mul else N % cfg.block_n == 0, EVEN_K=K % tile == 0,
        BLOCK_N=cfg.block_n, GROUPS=shape[0],
        GROUP_WORDS=shape[1], ASM=asm, PREFETCH=int(cfg.prefetch), PAIR=asm and cfg.pair and shape[1] >= 2,
        SILU_MUL=silu_mul, n_ss=ss.numel() if ss is not None else 1, eps=float(eps), RSTD=rstd_sumsq is not None,
        SS_BLOCK=triton.next_power_of_2(ss.numel()) if ss is not None else 1, **hand,
        TRIGGER=trigger if split == 1 else 0, WAIT=wait, PRELOAD=wait and pdl_preload and K % tile == 0,
        L2_AHEAD=cfg.l2_ahead if x.is_cuda and not interpreting() else 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl,
    )
    if split > 1:  # one reduce program per cfg.block_n rows under add_sumsq: one partial sum each, as unsplit
        block = cfg.block_n if add_sumsq is not None else 1024
        _splitk_reduce_kernel[(1, triton.cdiv(N, block))](dst, b, out, 1, N, out.stride(0), SPLIT=split,
                                                       HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
                                                       TRIGGER=1 if trigger else 0, **hand)
    return out
