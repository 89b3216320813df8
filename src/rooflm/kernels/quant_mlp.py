# The SwiGLU MLP of one decode row with packed weights in one launch: gate_up_proj, SiLU-and-mul and down_proj,
# split over the intermediate dimension, then a fixed-order reduction of the programs' partial sums.
#
# Why. At one row each projection is a GEMV that streams its weight once, and each kernel spends a few microseconds
# outside its steady stream (the first loads, the last programs draining): measured on an H100 at 4 bits
# (docs/benchmarks.md) gate_up_proj took 22.6 us for 16.0 us of bytes and down_proj 12.4 + 1.6 us (its K-split
# reduction) for 8.0 us. A persistent kernel that runs the layer's dependent steps one after another needs a grid-wide
# barrier between them, which measured dearer than the kernel boundary it replaces. The MLP needs none if it is cut
# along the intermediate dimension instead: program p takes intermediate columns [p B, p B + B), i.e. rows j of gate
# and j of up for those columns (the word GEMV's SiLU-and-mul tile of 2 B rows, rooflm/kernels/quant_gemv.py), forms
# act = silu(gate) * up for them, and multiplies down_proj's columns [p B, p B + B) by it: a partial sum for every
# output row, which only needs the program's own B activations. The partial sums (P = intermediate / B of them, in
# float32) are added by a second, small kernel in an order fixed by its constants, which also does the handoff
# epilogue (residual add and the next norm's statistic, rooflm/kernels/handoff_gemv.py): results do not depend on
# scheduling (atomic float adds into one row would need no second kernel, but would round in arrival order). The
# bytes streamed are those of the two weights plus P x hidden x 4 of partial sums (2.8 MB for Llama-2-7B at B = 64,
# written and read back through the L2).
#
# * The activations a program made are stored to ``act`` (they are the unfused pair's intermediate row, rounded the
#   same way) and read back by the program's other threads after a barrier, in the x pairs the word GEMV's
#   float16x2 products take (``quant_gemv_tile._xw``).
# * Phase 1 is the word GEMV's loop (``quant_gemv_tile``) with its handoff consumer's 1/rms scale, so ``act`` is bit
#   for bit what ``packed_rmsnorm_sumsq_gemv(..., silu_mul=True)`` stores with the same tile. Phase 2 runs down_proj
#   rows in tiles of ``down_rows`` rows x B columns (B / 8 words a row at 4 bits), the next tile's words and scales
#   loaded before this tile's products. Each program's B columns must lie in one quantization group of down_proj.
# * Opt-in (``ROOFLM_QUANT_MLP=auto``) until it is measured faster in a decode step on a GPU (docs/quantization.md).
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rooflm.kernels._tl import (add_sumsq_inputs, add_sumsq_store, gdc_wait, pdl_edges, pdl_launch, pdl_trigger_late,
                                rstd_of_partials, sumsq_partials)
from rooflm.kernels._utils import interpreting
from rooflm.kernels.gemv import _silu_mul_pairs
from rooflm.kernels.quant_gemv import gemv_words, tile_groups
from rooflm.kernels.quant_gemv_tile import (_accumulate, _accumulate_late, _params, _products, _rows, _words, _xw)
from rooflm.quantization.packed import PackedWeight


@triton.jit
def _fused_mlp_kernel(
    x_ptr, xw_ptr, gq_ptr, gs_ptr, gm_ptr, dq_ptr, ds_ptr, dm_ptr, act_ptr, aw_ptr, part_ptr, ss_ptr,
    H, I, GROUP_G: tl.constexpr, GROUP_D: tl.constexpr,  # groups and row strides constant: see quant_gemv.py
    stride_gq: tl.constexpr, stride_gs: tl.constexpr, stride_dq: tl.constexpr, stride_ds: tl.constexpr, n_ss, eps,
    BITS: tl.constexpr, HAS_MIN: tl.constexpr, BLOCK_I: tl.constexpr, GROUPS: tl.constexpr,
    GROUP_WORDS: tl.constexpr, DOWN_ROWS: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr,
    PAIR: tl.constexpr, PAIR_D: tl.constexpr, RSTD: tl.constexpr, SS_BLOCK: tl.constexpr, TRIGGER: tl.constexpr,
    WAIT: tl.constexpr,
):
    PER: tl.constexpr = 32 // BITS  # codes per word
    TILE: tl.constexpr = GROUPS * GROUP_WORDS * PER  # columns of x per phase-1 tile
    DW: tl.constexpr = BLOCK_I // PER  # words of a down_proj row in this program's columns
    pid = tl.program_id(0)
    # Phase 1: rows j and I + j of [gate | up] for j in this program's columns, over all H columns of x.
    offs_n, mask_n = _rows(pid, 2 * I, 2 * BLOCK_I, True)
    offs_g = tl.arange(0, GROUPS)
    wtile = offs_g[:, None] * GROUP_WORDS + tl.arange(0, GROUP_WORDS)[None, :]
    rows = gq_ptr + offs_n.to(tl.int64)[:, None, None] * stride_gq
    if PREFETCH:  # the first tile's words (which no kernel writes) may load before the wait
        u = _words(rows, mask_n, wtile, 0, H, PER, True, False)
    if WAIT:
        gdc_wait()
    ss_parts = 0.0
    if RSTD:
        ss_parts = sumsq_partials(ss_ptr, n_ss, SS_BLOCK)
    acc = tl.zeros([2 * BLOCK_I, GROUPS, GROUP_WORDS // 2 if PAIR else GROUP_WORDS], tl.float32)
    if PREFETCH:
        sc, mn = _params(gs_ptr, gm_ptr, offs_n, mask_n, offs_g, 0, H, GROUP_G, stride_gs, HAS_MIN, True, False)
        xq = _xw(xw_ptr, wtile, 0, H, BITS, False, ASM)
        for k0 in range(0, H, TILE):
            k_next = tl.minimum(k0 + TILE, H - TILE)  # the last tile loads itself again (unused)
            u_next = _words(rows, mask_n, wtile, k_next, H, PER, True, False)
            sc_next, mn_next = _params(gs_ptr, gm_ptr, offs_n, mask_n, offs_g, k_next, H, GROUP_G, stride_gs,
                                       HAS_MIN, True, False)
            xq_next = _xw(xw_ptr, wtile, k_next, H, BITS, False, ASM)
            p, xs = _products(u, xq, x_ptr, wtile, k0, H, BITS, HAS_MIN, False, ASM, PAIR, 2 * BLOCK_I, GROUPS,
                              GROUP_WORDS)
            acc = _accumulate(acc, p, xs, sc, mn, BITS, HAS_MIN, ASM, PAIR)
            u = u_next
            xq = xq_next
            sc = sc_next
            mn = mn_next
    else:
        for k0 in range(0, H, TILE):
            u = _words(rows, mask_n, wtile, k0, H, PER, True, False)
            p, xs = _products(u, _xw(xw_ptr, wtile, k0, H, BITS, False, ASM), x_ptr, wtile, k0, H, BITS, HAS_MIN,
                              False, ASM, PAIR, 2 * BLOCK_I, GROUPS, GROUP_WORDS)
            acc = _accumulate_late(acc, p, xs, gs_ptr, gm_ptr, offs_n, mask_n, offs_g, k0, H, GROUP_G, stride_gs,
                                   BITS, HAS_MIN, True, False, ASM, PAIR)
    # Phase 2's first tile of down_proj (which does not depend on the activations) is in flight meanwhile.
    offs_d = tl.arange(0, 1)
    dtile = tl.arange(0, DW)[None, :]  # [1 group, DW words]
    offs_r = tl.arange(0, DOWN_ROWS)
    true_r = offs_r < DOWN_ROWS
    drows = dq_ptr + offs_r.to(tl.int64)[:, None, None] * stride_dq
    j0 = pid * BLOCK_I
    u = _words(drows, true_r, dtile, j0, I, PER, True, False)
    sc, mn = _params(ds_ptr, dm_ptr, offs_r, true_r, offs_d, j0, I, GROUP_D, stride_ds, HAS_MIN, True, False)
    res = tl.sum(tl.sum(acc, 2), 1)
    if RSTD:  # x is h * norm_weight from the handoff producer: the sums times 1/rms(h)
        res = res * rstd_of_partials(ss_parts, H, eps)
    g, up = tl.split(tl.reshape(res, [BLOCK_I, 2]))
    tl.store(act_ptr + j0 + tl.arange(0, BLOCK_I), _silu_mul_pairs(g, up, act_ptr))
    tl.debug_barrier()  # the program's activations, stored by some of its threads, are read by all of them
    # Phase 2: down_proj's columns [j0, j0 + BLOCK_I), every row, DOWN_ROWS rows a tile.
    aq = _xw(aw_ptr, dtile, j0, I, BITS, False, ASM)
    for r0 in range(0, H, DOWN_ROWS):
        r_next = tl.minimum(r0 + DOWN_ROWS, H - DOWN_ROWS)  # the last tile loads itself again (unused)
        u_next = _words(drows + r_next.to(tl.int64) * stride_dq, true_r, dtile, j0, I, PER, True, False)
        sc_next, mn_next = _params(ds_ptr, dm_ptr, r_next + offs_r, true_r, offs_d, j0, I, GROUP_D, stride_ds,
                                   HAS_MIN, True, False)
        p, xs = _products(u, aq, act_ptr, dtile, j0, I, BITS, HAS_MIN, False, ASM, PAIR_D, DOWN_ROWS, 1, DW)
        part = _accumulate(tl.zeros([DOWN_ROWS, 1, DW // 2 if PAIR_D else DW], tl.float32), p, xs, sc, mn, BITS,
                           HAS_MIN, ASM, PAIR_D)
        tl.store(part_ptr + pid * H + r0 + offs_r, tl.sum(tl.sum(part, 2), 1))
        u = u_next
        sc = sc_next
        mn = mn_next
    pdl_trigger_late(TRIGGER)


@triton.jit
def _partials_reduce_kernel(part_ptr, b_ptr, out_ptr, P, H, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
                            P_CHUNK: tl.constexpr, r_ptr=None, nw_ptr=None, ro_ptr=None, ss_ptr=None,
                            ADD_SUMSQ: tl.constexpr = False, TRIGGER: tl.constexpr = False,
                            WAIT: tl.constexpr = False):
    """out[BLOCK outputs] = the sum of the P programs' partial sums (+ bias), P_CHUNK programs' rows at a time, in
    an order fixed by the constants; with ADD_SUMSQ the handoff producer's epilogue (``add_sumsq_store``). The
    split-K reduction of rooflm/kernels/gemv.py does the same for a few splits with one unrolled load each; here P
    is 86-344 (intermediate / block_i), so the rows are loaded as [P_CHUNK, BLOCK] tiles in a loop instead."""
    pdl_edges(TRIGGER, WAIT)
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    rows = tl.arange(0, P_CHUNK)
    acc = tl.zeros([BLOCK], tl.float32)
    for p0 in range(0, P, P_CHUNK):
        live = (p0 + rows < P)[:, None] & mask[None, :]
        acc += tl.sum(tl.load(part_ptr + (p0 + rows)[:, None] * H + offs[None, :], mask=live, other=0.0), 0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ADD_SUMSQ:
        r, nw = add_sumsq_inputs(r_ptr, nw_ptr, offs, mask)
        add_sumsq_store(out_ptr, acc, offs, mask, pid, r, nw, ro_ptr, ss_ptr)
    else:
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class FusedMlpConfig:
    """One launch of the fused MLP: ``block_i`` intermediate columns a program (2 x block_i rows of [gate | up]),
    ``words`` 32-bit words of a gate_up row a tile, ``down_rows`` rows of down_proj a tile, the gate_up tile loaded
    one ahead (``prefetch``) or not, ``pair`` as in the word GEMV; the reduction adds ``reduce_block`` outputs a
    program."""
    block_i: int
    words: int
    down_rows: int
    num_warps: int = 4
    prefetch: int = 1
    pair: bool = False
    reduce_block: int = 32

    def __post_init__(self) -> None:
        for name in ("block_i", "words", "down_rows", "reduce_block"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"{name}={v!r}: expected a power of two")
        if self.prefetch not in (0, 1):
            raise ValueError(f"prefetch={self.prefetch!r}: expected 0 or 1 tiles ahead")


def short_name(c: FusedMlpConfig) -> str:
    """A configuration in a few characters, for reports: intermediate columns a program, gate_up words a tile,
    down rows a tile, warps, "p" for the tile loaded ahead, "2" for two words a sum."""
    return (f"mlp{c.block_i}x{c.words}w/d{c.down_rows}/{c.num_warps}w" + "p" * c.prefetch + ("2" if c.pair else "")
            + f"/r{c.reduce_block}")


def fits(gate_up: PackedWeight, down: PackedWeight, cfg: FusedMlpConfig) -> bool:
    """True when the fused MLP can run ``cfg`` on these weights: [gate | up] of [2 I, H] and down of [H, I], the same
    width, no act-order permutation, gate_up's rows whole tiles of ``cfg.words``, each program's intermediate columns
    inside one group of down_proj and whole words, down's rows whole tiles."""
    hidden, inter = gate_up.in_features, gate_up.out_features // 2
    if (gate_up.out_features % 2 or down.in_features != inter or down.out_features != hidden
            or gate_up.bits != down.bits or gate_up.bits not in (4, 8) or gate_up.perm is not None
            or down.perm is not None or (gate_up.mins is None) != (down.mins is None)
            or gemv_words(gate_up) is None or gemv_words(down) is None):
        return False
    per = 32 // gate_up.bits
    shape = tile_groups(cfg.words, hidden, gate_up.bits, gate_up.group_size)
    return (shape is not None and hidden % (cfg.words * per) == 0 and inter % cfg.block_i == 0
            and cfg.block_i % per == 0 and (down.group_size % cfg.block_i == 0 or down.group_size == inter)
            and hidden % cfg.down_rows == 0 and hidden % cfg.reduce_block == 0)


def candidates(gate_up: PackedWeight, down: PackedWeight) -> list[FusedMlpConfig]:
    """The configurations ``pick_fused_mlp`` times (those that ``fits``). Few programs keep the partial sums small
    (intermediate / block_i rows of hidden floats: 2.8 MB for Llama-2-7B at 64 columns a program, 11 MB at 16),
    and the grid should be resident at once (no second wave). Compiled for sm_90 (Triton 3.9, 4 bits in groups of
    128 with mins), the tiles below take 128 registers a thread (the eight- and sixteen-warp tiles, and 32 columns
    of 32 words) to 209-255 (the four-warp tiles of 64 words or 64 columns, and 64 x 64 words on eight warps): on
    the 132 multiprocessors of an H100 all of Llama-2-7B's 86-344 programs are resident at once except for those
    two of 64 words (a second wave), which the picker's timings are left to judge. They keep 16-32 words a thread in
    flight in each phase (a down_proj tile of 512 rows x 8 words at 4 bits is 16 KiB)."""
    out = [FusedMlpConfig(64, 32, 512, 4, 1), FusedMlpConfig(64, 32, 512, 8, 1), FusedMlpConfig(64, 64, 512, 8, 1),
           FusedMlpConfig(32, 64, 1024, 4, 1), FusedMlpConfig(32, 32, 512, 4, 1), FusedMlpConfig(128, 32, 512, 16, 1),
           FusedMlpConfig(64, 32, 256, 8, 1), FusedMlpConfig(64, 32, 512, 4, 1, pair=True)]
    return [c for c in out if fits(gate_up, down, c)]


def fused_mlp(x: torch.Tensor, gate_up: PackedWeight, down: PackedWeight, cfg: FusedMlpConfig,
              rstd_sumsq: torch.Tensor | None = None, eps: float = 0.0, down_bias: torch.Tensor | None = None,
              add_sumsq: tuple | None = None, pdl_wait: bool = False, pdl_trigger: int = 0,
              act: torch.Tensor | None = None) -> torch.Tensor:
    """down(silu(gate) * up) of one row x [1, H] (no gate_up bias), in one launch plus the reduction. With
    ``rstd_sumsq`` x is the handoff producer's h * norm_weight and the gate_up sums are scaled by 1/rms (as
    ``packed_rmsnorm_sumsq_gemv``); with ``add_sumsq`` = (residual, norm_weight, h, sumsq) the reduction is the next
    handoff's producer (as ``packed_add_sumsq``: returns h * norm_weight, writes h and the partial sums of squares).
    ``pdl_wait``: both kernels are launched with programmatic dependent launch and wait in place for the one
    before them (the fused one, with ``prefetch``, after loading its first gate_up tile; it lets the reduction in
    after its loops); ``pdl_trigger``: the reduction lets the next kernel in at its start. ``act`` [1, I] (x's dtype):
    where the activations go (a new tensor if None)."""
    hidden, inter = gate_up.in_features, gate_up.out_features // 2
    if x.dim() != 2 or x.shape != (1, hidden) or x.stride(1) != 1:
        raise ValueError(f"x must be one contiguous row [1, {hidden}]; got {tuple(x.shape)} (strides {x.stride()})")
    if not fits(gate_up, down, cfg):
        raise ValueError(f"{cfg} does not fit gate_up {tuple(gate_up.qweight.shape)} ({gate_up.bits} bits, group "
                         f"{gate_up.group_size}) and down {tuple(down.qweight.shape)} (group {down.group_size})")
    per = 32 // gate_up.bits
    shape = tile_groups(cfg.words, hidden, gate_up.bits, gate_up.group_size)
    asm = x.dtype == torch.float16 and x.is_cuda and not interpreting() and x.data_ptr() % 4 == 0
    if act is None:
        act = torch.empty(1, inter, dtype=x.dtype, device=x.device)
    elif act.shape != (1, inter) or act.dtype != x.dtype or not act.is_contiguous():
        raise ValueError(f"act must be a contiguous [1, {inter}] {x.dtype} tensor; got {act.dtype} {tuple(act.shape)}")
    progs = inter // cfg.block_i
    part = torch.empty(progs, 1, hidden, dtype=torch.float32, device=x.device)
    gq, dq = gemv_words(gate_up), gemv_words(down)
    ss = rstd_sumsq if rstd_sumsq is not None else part
    _, wait, pdl = pdl_launch(0, pdl_wait, x.device)
    trigger, _, _ = pdl_launch(pdl_trigger, False, x.device)
    _fused_mlp_kernel[(progs,)](
        x, x.view(torch.int32) if asm else x, gq, gate_up.scales,
        gate_up.mins if gate_up.mins is not None else gate_up.scales, dq, down.scales,
        down.mins if down.mins is not None else down.scales, act, act.view(torch.int32) if asm else act, part, ss,
        hidden, inter, gate_up.group_size, down.group_size, gq.stride(0), gate_up.scales.stride(0), dq.stride(0),
        down.scales.stride(0), ss.numel() if rstd_sumsq is not None else 1, float(eps),
        BITS=gate_up.bits, HAS_MIN=gate_up.mins is not None, BLOCK_I=cfg.block_i, GROUPS=shape[0],
        GROUP_WORDS=shape[1], DOWN_ROWS=cfg.down_rows, ASM=asm, PREFETCH=cfg.prefetch,
        PAIR=asm and cfg.pair and shape[1] >= 2, PAIR_D=asm and cfg.pair and cfg.block_i // per >= 2,
        RSTD=rstd_sumsq is not None, SS_BLOCK=triton.next_power_of_2(ss.numel()) if rstd_sumsq is not None else 1,
        TRIGGER=2 if wait else 0, WAIT=wait, num_warps=cfg.num_warps, num_stages=1, **pdl)
    r, nw, h, sumsq = add_sumsq if add_sumsq is not None else (None,) * 4
    block = cfg.reduce_block
    out = torch.empty(1, hidden, dtype=x.dtype, device=x.device)
    _partials_reduce_kernel[(triton.cdiv(hidden, block),)](
        part, down_bias if down_bias is not None else out, out, progs, hidden, HAS_BIAS=down_bias is not None,
        BLOCK=block, P_CHUNK=max(1, min(triton.next_power_of_2(progs), 4096 // block)), r_ptr=r, nw_ptr=nw,
        ro_ptr=h, ss_ptr=sumsq, ADD_SUMSQ=add_sumsq is not None, TRIGGER=1 if trigger else 0, WAIT=wait, num_warps=4,
        **pdl)
    return out


def fused_mlp_ref(x: torch.Tensor, gate_up: PackedWeight, down: PackedWeight,
                  down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The twin in float64: down(silu(gate) * up) with both weights dequantized, act rounded to x's dtype."""
    from rooflm.quantization.packed import dequantize

    gu = x.double() @ dequantize(gate_up).double().T
    g, up = gu.chunk(2, dim=-1)
    a = (torch.nn.functional.silu(g) * up).to(x.dtype).double()
    out = a @ dequantize(down).double().T
    return (out + down_bias.double() if down_bias is not None else out).to(x.dtype)


# Whether a layer runs the fused MLP is measured on the running device the first time a shape is seen, as the
# handoffs are (rooflm/kernels/handoff_gemv.py): the candidates against the pair of word GEMVs the layer runs
# otherwise (its tiles given), both handed over at their ends and replayed from CUDA graphs over weight copies
# beyond the L2. ``ROOFLM_FUSED_GEMV=off`` turns it off with the other fusions; ``on`` takes the first candidate that
# fits without the comparison.
_picked: dict[tuple, FusedMlpConfig | None] = {}
DEFAULT_MODE = "off"


def quant_mlp_mode() -> str:
    """``ROOFLM_QUANT_MLP``: "auto" (the layer times the fused MLP against its pair of word GEMVs and keeps the
    faster) or "off" (the pair always); the default is ``DEFAULT_MODE``."""
    mode = os.environ.get("ROOFLM_QUANT_MLP", DEFAULT_MODE)
    if mode not in ("auto", "off"):
        raise ValueError(f"ROOFLM_QUANT_MLP={mode!r} is invalid: expected auto or off")
    return mode


def pick_fused_mlp(y: torch.Tensor, sumsq: torch.Tensor, eps: float, gate_up: PackedWeight, down: PackedWeight,
                   down_bias: torch.Tensor | None, unfused: tuple, launch: bool = False) -> FusedMlpConfig | None:
    """The configuration the decode layer runs its MLP with from the handoff (``y`` = h * norm_weight [1, H] and the
    producer's ``sumsq``), or None where the pair of word GEMVs with the tiles ``unfused`` = (gate_up's, down's) was
    faster or nothing fits. ``launch``: both timed under the layer's programmatic dependent launches. Decided once
    per shape on CUDA outside a CUDA-graph capture; None elsewhere and inside a capture of an unseen shape."""
    from rooflm.kernels.fused_gemv import fused_gemv_mode

    key = (gate_up.out_features, gate_up.in_features, down.in_features, gate_up.bits, gate_up.group_size,
           down.group_size, gate_up.mins is not None, down_bias is not None, y.dtype, y.device, launch)
    if key in _picked:
        return _picked[key]
    cands = candidates(gate_up, down)
    if (not y.is_cuda or interpreting() or torch.cuda.is_current_stream_capturing() or not cands
            or fused_gemv_mode() == "off"):
        return None
    if fused_gemv_mode() == "on":
        _picked[key] = cands[0]
        return cands[0]
    from rooflm.kernels._utils import DOWN_TO_QKV, O_TO_GATE_UP, packed_copies, time_in_graph
    from rooflm.kernels.handoff_gemv import packed_add_sumsq, packed_rmsnorm_sumsq_gemv

    hidden = gate_up.in_features
    res = torch.randn(1, hidden, dtype=y.dtype, device=y.device)
    nw = torch.ones(hidden, dtype=y.dtype, device=y.device)
    pairs = list(zip(packed_copies(gate_up), packed_copies(down)))
    plan = (O_TO_GATE_UP.consumer(), DOWN_TO_QKV.producer()) if launch else ({}, {})

    def pair(w):
        a = packed_rmsnorm_sumsq_gemv(y, sumsq, eps, w[0], None, unfused[0], True, **plan[0])
        return packed_add_sumsq(a, w[1], down_bias, unfused[1], res, nw, **plan[1])[0]

    def fused(w, c):
        h = torch.empty_like(res)
        ss = torch.empty(triton.cdiv(hidden, c.reduce_block), dtype=torch.float32, device=y.device)
        return fused_mlp(y, w[0], w[1], c, sumsq, eps, down_bias, (res, nw, h, ss), pdl_wait=launch,
                         pdl_trigger=1 if launch else 0)

    results = [(time_in_graph(pair, pairs, y.device), None)]
    results += [(time_in_graph(lambda w, c=c: fused(w, c), pairs, y.device), c) for c in cands]
    if os.environ.get("ROOFLM_GEMV", "auto") == "verbose":
        print(f"[rooflm.quant_mlp] {key[:6]} launch={launch}: " + ", ".join(
            f"{'unfused' if c is None else short_name(c)}={t * 1e3:.2f}us" for t, c in results))
    best = min(results, key=lambda r: r[0])  # the first of equals: the pair
    _picked[key] = best[1]
    return best[1]


def choices() -> dict[tuple, str]:
    """What ``pick_fused_mlp`` picked so far, for reports: {shape key: ``short_name`` of the pick, or "unfused"}."""
    return {k: "unfused" if v is None else short_name(v) for k, v in _picked.items()}


# The decode layer's entry (rooflm/models/llama.py): one decision per shape for every layer, the tile of the next
# layer's handed-over qkv_proj with it.
_layer_picked: dict[tuple, tuple | None] = {}


def layer_mlp(y: torch.Tensor, sumsq: torch.Tensor, gate_up_cfg, residual: torch.Tensor, eps: float, gate_up,
              down, next_norm, next_proj, pdl: bool) -> tuple | None:
    """The MLP of a decode row handed over from o_proj (``y``, ``sumsq``, ``residual`` and the tile ``gate_up_cfg``
    that gate_up_proj's word GEMV would run), handing the next norm over to ``next_proj``: (residual, scaled, sumsq,
    the configuration for ``next_proj``) as a ``NormHandoff`` holds them, or None where the layer's pair of word
    GEMVs runs instead (not packed, a gate_up bias, not measured faster, or not yet decided inside a capture).
    ``gate_up``, ``down``, ``next_proj``: the layer's ``Linear`` modules; ``next_norm`` the next layer's RMSNorm."""
    from rooflm.kernels.quant_gemv import QuantGemvConfig

    gu, dn, nq = gate_up.packed_weight, down.packed_weight, next_proj.packed_weight
    if (gu is None or dn is None or nq is None or gate_up.bias is not None or not y.is_cuda
            or not isinstance(gate_up_cfg, QuantGemvConfig) or quant_mlp_mode() == "off"):
        return None
    key = (gu.out_features, gu.in_features, dn.in_features, nq.out_features, gu.bits, nq.bits, gu.group_size,
           dn.group_size, nq.group_size, down.bias is not None, next_proj.bias is not None, y.dtype, y.device, pdl)
    if key not in _layer_picked:
        if torch.cuda.is_current_stream_capturing():
            return None
        from rooflm.kernels._utils import DOWN_TO_QKV
        from rooflm.kernels.handoff_gemv import pick_handoff_packed

        act = torch.randn(1, dn.in_features, dtype=y.dtype, device=y.device)
        then = pick_handoff_packed(act, dn, down.bias, nq, next_proj.bias, next_norm.eps, False,
                                   DOWN_TO_QKV if pdl else None)
        cfg = None if then is None else pick_fused_mlp(y, sumsq, eps, gu, dn, down.bias, (gate_up_cfg, then[0]),
                                                       pdl)
        _layer_picked[key] = None if cfg is None else (cfg, then[1])
    pick = _layer_picked[key]
    if pick is None:
        return None
    cfg, then = pick
    h = torch.empty_like(residual)
    ss = torch.empty(triton.cdiv(gu.in_features, cfg.reduce_block), dtype=torch.float32, device=y.device)
    scaled = fused_mlp(y, gu, dn, cfg, sumsq, eps, down.bias, (residual, next_norm.weight, h, ss), pdl_wait=pdl,
                       pdl_trigger=1 if pdl else 0)
    return h, scaled, ss, then
