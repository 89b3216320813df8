# GEMV and flat GEMM for the linear layers at small batch, picked per shape against torch's matmul.
#
# Technique: FlashDecoding++ (Hong et al. 2024, "FlashDecoding++: Faster Large Language Model Inference on GPUs",
# section 5): during decode a linear layer is y[M, N] = x[M, K] @ W[N, K]^T with M = batch (1-16) and N, K in the
# thousands -- a "flat" GEMM. Its cost is reading W once (N*K elements); a GEMM library tiles M to 64 or 128 rows and
# may under-use memory bandwidth on such shapes. FlashDecoding++ keeps GEMV, flat-GEMM and GEMM implementations and
# picks one per (M, N, K) from measurements; ``linear`` here does the same on the running device: the first time a
# shape bucket is seen (outside a CUDA-graph capture) it times each candidate below against ``torch.nn.functional.
# linear``, replaying both from a CUDA graph over copies of the real weight that together exceed the L2 (so W comes
# from device memory, as in a real decode step, and launch overhead is not counted), and keeps the fastest.
#
# Kernels (W is [N, K] row-major, nn.Linear's layout; x [M, K]; out [M, N]):
#   * sum:  M == 1. A program owns BLOCK_N output columns; it streams [BLOCK_N, BLOCK_K] tiles of W, multiplies
#           by the x chunk and accumulates in float32 registers, reducing over K once at the end.
#   * dot:  1 <= M <= 16. The same streaming, but x is a 16-row tile (rows >= M masked) and the product goes
#           through tl.dot (tensor cores), so one kernel serves every flat batch size.
#   Both can split K over SPLIT_K programs (more programs in flight when N is small); the partial sums go to a
#   float32 workspace [SPLIT_K, M, N] and a small kernel adds them (and the bias) in a fixed order, so the result
#   does not depend on scheduling.
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rooflm.kernels._tl import (add_sumsq_inputs, add_sumsq_store, dot, dot_upcast, gdc_wait, pdl_edges,
                                pdl_launch, pdl_trigger_late, rstd_of_partials, sumsq_partials)
from rooflm.kernels._utils import interpreting, time_in_graph, weight_copies  # noqa: F401 (part of this API)


# What a GEMV program computes from its input rows before the product (a "prologue"), so that the elementwise op
# before a projection needs no kernel of its own (``rooflm/kernels/fused_gemv.py``):
PRO_NONE = 0  # x as it is
PRO_RMSNORM = 1  # rms_norm(x [+ residual]) * norm_weight, in the roundings of rooflm/kernels/rmsnorm.py
PRO_SILU_MUL = 2  # silu(gate) * up of a [gate | up] row, in the roundings of rooflm/kernels/activation.py
PRO_RMSNORM_ONE_PASS = 3  # M == 1, one K split: sum(W * (x [+ residual]) * norm_weight) * rstd, in float32
PRO_RMSNORM_SUMSQ = 4  # M == 1: x is residual * norm_weight from EPI 2; the sums times 1/rms from its partial sums
# ... and what it does with its sums before it stores them (an "epilogue"):
EPI_NONE = 0
EPI_SILU_MUL = 1  # W is [gate | up] (2N rows): each program takes N-rows of gate and the same rows of up, stores
                  # silu(gate) * up [M, N] with the roundings of rooflm/kernels/activation.py; one K split only
EPI_ADD_SUMSQ = 2  # M == 1, one K split: h = out + residual (rounded as the add + norm kernel rounds it) to
                   # residual_out, h * norm_weight to out, each program's sum(h^2) to sumsq (see add_sumsq_store)


@triton.jit
def _stream_row(x_ptr, r_ptr, xo, ro, mask, HAS_RES: tl.constexpr, MASKED: tl.constexpr):
    """The residual stream a norm reads: x, or x + residual rounded to x's dtype."""
    if MASKED:
        s = tl.load(x_ptr + xo, mask=mask, other=0.0)
    else:
        s = tl.load(x_ptr + xo)
    if HAS_RES:
        if MASKED:
            r = tl.load(r_ptr + ro, mask=mask, other=0.0)
        else:
            r = tl.load(r_ptr + ro)
        s = (s.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return s


@triton.jit
def _input_tile(x_ptr, r_ptr, nw_ptr, xo, ro, offs_k, mask, mask_k, rstd, up_off,
                PRO: tl.constexpr, HAS_RES: tl.constexpr, MASKED: tl.constexpr, EVEN_K: tl.constexpr):
    """The GEMV input at offsets xo (a [BLOCK_K] or [16, BLOCK_K] tile) after the prologue PRO."""
    if PRO == 1:
        s = _stream_row(x_ptr, r_ptr, xo, ro, mask, HAS_RES, MASKED)
        y = (s.to(tl.float32) * rstd).to(x_ptr.dtype.element_ty)
        if EVEN_K:
            nw = tl.load(nw_ptr + offs_k)
        else:
            nw = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0)
        v = (nw.to(tl.float32) * y.to(tl.float32)).to(x_ptr.dtype.element_ty)
    elif PRO == 2:
        if MASKED:
            g = tl.load(x_ptr + xo, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(x_ptr + up_off + xo, mask=mask, other=0.0)
        else:
            g = tl.load(x_ptr + xo).to(tl.float32)
            u = tl.load(x_ptr + up_off + xo)
        a = (g / (1.0 + tl.exp(-g))).to(x_ptr.dtype.element_ty)
        v = (a.to(tl.float32) * u.to(tl.float32)).to(x_ptr.dtype.element_ty)
    else:
        if MASKED:
            v = tl.load(x_ptr + xo, mask=mask, other=0.0)
        else:
            v = tl.load(x_ptr + xo)
    return v


@triton.jit
def _silu_mul_pairs(g, u, out_ptr):
    """silu(gate) * up from float32 sums, each rounded to the output dtype first (as the unfused pair rounds them)."""
    dt = out_ptr.dtype.element_ty
    gf = g.to(dt).to(tl.float32)
    a = (gf / (1.0 + tl.exp(-gf))).to(dt)
    return (a.to(tl.float32) * u.to(dt).to(tl.float32)).to(dt)


@triton.jit
def _store_row(out_ptr, acc, offs_n, mask_n, pid_n, N, epi_in, ro_ptr, ss_ptr, BLOCK_N: tl.constexpr,
               EPI: tl.constexpr):
    """One row's BLOCK_N sums: stored as they are, (EPI 1) as silu(gate) * up of their interleaved pairs, or (EPI 2)
    through ``add_sumsq_store`` with epi_in = ``add_sumsq_inputs`` (loaded before the main loop)."""
    if EPI == 2:
        add_sumsq_store(out_ptr, acc, offs_n, mask_n, pid_n, epi_in[0], epi_in[1], ro_ptr, ss_ptr)
    elif EPI == 1:
        g, u = tl.split(tl.reshape(acc, [BLOCK_N // 2, 2]))
        oc = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_ptr + oc, _silu_mul_pairs(g, u, out_ptr), mask=oc < N)
    else:
        tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_om, stride_os,
    r_ptr, nw_ptr, ro_ptr, stride_rm, stride_rom, eps, up_off, ss_ptr, n_ss,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, USE_DOT: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    PRO: tl.constexpr = 0, HAS_RES: tl.constexpr = False, WRITE_RES: tl.constexpr = False, EPI: tl.constexpr = 0,
    SS_BLOCK: tl.constexpr = 1, TRIGGER: tl.constexpr = 0, WAIT: tl.constexpr = False,
    PRELOAD: tl.constexpr = False,  # launched to wait, like WAIT, after loading its first weight tile
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pdl_edges(TRIGGER, WAIT)  # programmatic dependent launch (decode attention after qkv_proj, o_proj after it)
    if EPI == 1:  # row j of the program: gate row (or, odd j, up row) of output column offs_o
        j = tl.arange(0, BLOCK_N)
        offs_o = pid_n * (BLOCK_N // 2) + j // 2
        offs_n = offs_o + (j % 2) * N
        mask_n = offs_o < N
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    offs_kb = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    offs_m = tl.arange(0, 16)
    mask_m = offs_m < M
    if PRELOAD:  # M == 1, one K split, whole tiles: the weight does not depend on the kernel waited for
        w_first = tl.load(w_rows + offs_kb[None, :])
        gdc_wait()
    epi_in = (r_ptr, nw_ptr)
    if EPI == 2:  # loaded now, used after the main loop (see rooflm/kernels/_tl.py)
        epi_in = add_sumsq_inputs(r_ptr, nw_ptr, offs_n, mask_n)
    ss_parts = 0.0
    if PRO == 4:
        ss_parts = sumsq_partials(ss_ptr, n_ss, SS_BLOCK)

    rstd = 1.0
    if PRO == 1:
        # RMSNorm's statistic needs the whole row before the first product: every program takes it over all of K
        # (the rows come from the L2 after the first program); the programs of the first column block and first
        # K split also write the new residual stream, to a buffer no program reads.
        first = (offs_kb * 0 + pid_n + pid_k) == 0  # as a tensor: a scalar mask is not broadcast everywhere
        if USE_DOT:
            ss = tl.zeros([16, BLOCK_K], tl.float32)
        else:
            ss = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + offs_kb
            if USE_DOT:
                pmask = mask_m[:, None] & (offs_k < K)[None, :]
                s = _stream_row(x_ptr, r_ptr, offs_m[:, None] * stride_xm + offs_k[None, :],
                                offs_m[:, None] * stride_rm + offs_k[None, :], pmask, HAS_RES, True)
                if WRITE_RES:
                    tl.store(ro_ptr + offs_m[:, None] * stride_rom + offs_k[None, :], s, mask=pmask & first[None, :])
            else:
                pmask = offs_k < K
                s = _stream_row(x_ptr, r_ptr, offs_k, offs_k, pmask, HAS_RES, True)
                if WRITE_RES:
                    tl.store(ro_ptr + offs_k, s, mask=pmask & first)
            sf = s.to(tl.float32)
            ss += sf * sf
        if USE_DOT:
            rstd = tl.rsqrt(tl.sum(ss, 1) / K + eps)[:, None]
        else:
            rstd = tl.rsqrt(tl.sum(ss, 0) / K + eps)

    if USE_DOT:
        acc = tl.zeros([16, BLOCK_N], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k0 = tl.multiple_of(k0, 16)  # k_per_split is a multiple of BLOCK_K: 16-byte vector loads
            offs_k = k0 + offs_kb
            mask_k = offs_k < k_hi
            xo = offs_m[:, None] * stride_xm + offs_k[None, :]
            ro = offs_m[:, None] * stride_rm + offs_k[None, :]
            if EVEN_K:
                x = _input_tile(x_ptr, r_ptr, nw_ptr, xo, ro, offs_k, mask_m[:, None], mask_k, rstd, up_off,
                                PRO, HAS_RES, True, True)
                if EVEN_N:
                    w = tl.load(w_rows + offs_k[None, :])
                else:
                    w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None], other=0.0)
            else:
                x = _input_tile(x_ptr, r_ptr, nw_ptr, xo, ro, offs_k, mask_m[:, None] & mask_k[None, :], mask_k,
                                rstd, up_off, PRO, HAS_RES, True, False)
                w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            acc += dot(x, tl.trans(w), DOT_UPCAST)
        pdl_trigger_late(TRIGGER)
        if HAS_BIAS and SPLIT == 1:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if EPI == 1:
            g, u = tl.split(tl.reshape(acc, [16, BLOCK_N // 2, 2]))
            oc = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            tl.store(out_ptr + offs_m[:, None] * stride_om + oc[None, :], _silu_mul_pairs(g, u, out_ptr),
                     mask=mask_m[:, None] & (oc < N)[None, :])
        else:
            o = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
            tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
    elif PRO == 3:  # M == 1, SPLIT == 1: the statistic gathered in the same pass, 1/rms applied to the sums
        first = (offs_kb * 0 + pid_n) == 0
        ss = tl.zeros([BLOCK_K], tl.float32)
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k0 = tl.multiple_of(k0, 16)
            offs_k = k0 + offs_kb
            mask_k = offs_k < K
            s = _stream_row(x_ptr, r_ptr, offs_k, offs_k, mask_k, HAS_RES, not EVEN_K)
            if WRITE_RES:
                tl.store(ro_ptr + offs_k, s, mask=mask_k & first)
            sf = s.to(tl.float32)
            ss += sf * sf
            if EVEN_K:
                nw = tl.load(nw_ptr + offs_k)
                if EVEN_N:
                    w = tl.load(w_rows + offs_k[None, :])
                else:
                    w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None], other=0.0)
            else:
                nw = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0)
                w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            acc2 += w.to(tl.float32) * (sf * nw.to(tl.float32))[None, :]
        pdl_trigger_late(TRIGGER)
        acc = tl.sum(acc2, 1) * tl.rsqrt(tl.sum(ss, 0) / K + eps)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        _store_row(out_ptr, acc, offs_n, mask_n, pid_n, N, epi_in, ro_ptr, ss_ptr, BLOCK_N, EPI)
    else:  # M == 1
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        k_start = k_lo
        if PRELOAD:  # the first iteration's product, in its order
            acc2 += w_first.to(tl.float32) * tl.load(x_ptr + offs_kb).to(tl.float32)[None, :]
            k_start = k_lo + BLOCK_K
        for k0 in range(k_start, k_hi, BLOCK_K):
            k0 = tl.multiple_of(k0, 16)  # k_per_split is a multiple of BLOCK_K: 16-byte vector loads
            offs_k = k0 + offs_kb
            mask_k = offs_k < k_hi
            if EVEN_K:
                x = _input_tile(x_ptr, r_ptr, nw_ptr, offs_k, offs_k, offs_k, mask_k, mask_k, rstd, up_off,
                                PRO, HAS_RES, False, True)
                if EVEN_N:
                    w = tl.load(w_rows + offs_k[None, :])
                else:
                    w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None], other=0.0)
            else:
                x = _input_tile(x_ptr, r_ptr, nw_ptr, offs_k, offs_k, offs_k, mask_k, mask_k, rstd, up_off,
                                PRO, HAS_RES, True, False)
                w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            acc2 += w.to(tl.float32) * x.to(tl.float32)[None, :]
        pdl_trigger_late(TRIGGER)
        acc = tl.sum(acc2, 1)
        if PRO == 4:
            acc = acc * rstd_of_partials(ss_parts, K, eps)
        if HAS_BIAS and SPLIT == 1:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        _store_row(out_ptr + pid_k * stride_os, acc, offs_n, mask_n, pid_n, N, epi_in, ro_ptr, ss_ptr, BLOCK_N, EPI)


@triton.jit
def _splitk_reduce_kernel(ws_ptr, b_ptr, out_ptr, M, N, stride_om, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK: tl.constexpr, r_ptr=None, nw_ptr=None, ro_ptr=None, ss_ptr=None,
                          ADD_SUMSQ: tl.constexpr = False,  # ADD_SUMSQ: M == 1, EPI 2 on the totals
                          TRIGGER: tl.constexpr = False):
    pdl_edges(TRIGGER, False)
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(ws_ptr + (s * M + m) * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ADD_SUMSQ:
        r, nw = add_sumsq_inputs(r_ptr, nw_ptr, offs, mask)
        add_sumsq_store(out_ptr, acc, offs, mask, tl.program_id(1), r, nw, ro_ptr, ss_ptr)
    else:
        tl.store(out_ptr + m * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class GemvConfig:
    use_dot: bool
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def supports(self, m: int) -> bool:
        return 1 <= m <= 16 if self.use_dot else m == 1


# Candidates timed by ``linear``. Keep this list short: each entry is one Triton compile per dtype at warm-up.
# Chosen from a sweep of 23 configurations over Llama-2-7B's five projection shapes at M = 1, 2, 4, 8, 16
# (``python -m rooflm.kernels.bench --sections gemv``, H200, docs/benchmarks.md): each entry below was the fastest,
# or within 1% of it, for at least one shape.
CANDIDATES: tuple[GemvConfig, ...] = (
    GemvConfig(False, 16, 256, 1, 4, 3),  # qkv
    GemvConfig(False, 8, 512, 1, 4, 3),  # down, and close on every shape
    GemvConfig(False, 4, 1024, 1, 4, 2),  # o (N = 4096: many small programs)
    GemvConfig(False, 32, 256, 1, 8, 3),  # gate_up
    GemvConfig(False, 16, 512, 1, 4, 2),  # lm_head
    GemvConfig(True, 32, 128, 1, 4, 4),  # qkv, M >= 2
    GemvConfig(True, 32, 128, 2, 4, 4),  # o and down, M >= 2 (split-K: more programs for N = 4096)
    GemvConfig(True, 64, 128, 1, 4, 4),  # gate_up, M >= 2
    GemvConfig(True, 64, 64, 1, 4, 6),  # lm_head, M >= 2
)
MAX_M = 16


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: GemvConfig) -> torch.Tensor:
    """out = x @ weight.T (+ bias) with one kernel configuration. x [..., K] with at most 16 rows; weight [N, K]."""
    shape = x.shape
    K = shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    check_weight(weight, K, shape)
    if not cfg.supports(x2.shape[0]):
        raise ValueError(f"{cfg} does not support M={x2.shape[0]}")
    return launch_gemv(x2, K, weight, bias, cfg).view(*shape[:-1], weight.shape[0])


def check_weight(weight: torch.Tensor, K: int, x_shape) -> None:
    if weight.dim() != 2 or weight.shape[1] != K or weight.stride(1) != 1:
        raise ValueError(f"weight {tuple(weight.shape)} (strides {weight.stride()}) does not fit x {tuple(x_shape)}")


def launch_gemv(
    x2: torch.Tensor, K: int, weight: torch.Tensor, bias: torch.Tensor | None, cfg: GemvConfig,
    prologue: int = PRO_NONE, residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
    eps: float = 0.0, residual_out: torch.Tensor | None = None, up_offset: int = 0, epilogue: int = EPI_NONE,
    sumsq: torch.Tensor | None = None, pdl_trigger: int = 0, pdl_wait: bool = False, pdl_preload: bool = False,
) -> torch.Tensor:
    """The launch behind ``gemv`` and the fused projections: x2 [M, *] row-major in its last dim, the product over
    its first K columns (after ``prologue``), then ``epilogue``. Callers check shapes. Returns out [M, N] (N: the
    weight's rows, half of them under ``EPI_SILU_MUL``). ``sumsq``: float32 partial sums of squares, written under
    ``EPI_ADD_SUMSQ`` (one per program) and read under ``PRO_RMSNORM_SUMSQ``. Programmatic dependent launch, where
    the GPU has it (``rooflm.kernels._tl.pdl_launch``): ``pdl_trigger`` lets the kernel launched next be scheduled
    early (from the last launch of this call): ``TRIGGER_START`` (1, True) once every program has started,
    ``TRIGGER_LATE`` (2) once every program is past its main loop (see ``rooflm.kernels.handoff_gemv``);
    ``pdl_wait`` launches this call so and waits before it reads anything; ``pdl_preload`` (with ``pdl_wait``) loads
    each program's first weight tile before the wait, where the GEMV is one row of whole tiles in one K split whose
    input is read as it is (no prologue, or the handoff's ``PRO_RMSNORM_SUMSQ``, which scales only the finished
    sums)."""
    M = x2.shape[0]
    N = weight.shape[0]
    rows_per_program = cfg.block_n
    if epilogue == EPI_SILU_MUL:
        if N % 2 or cfg.block_n < 2 or cfg.split_k != 1:
            raise ValueError(f"the SiLU-and-mul epilogue needs an even [gate | up] weight and one K split; got "
                             f"{N} rows, {cfg}")
        N, rows_per_program = N // 2, cfg.block_n // 2
    out = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    k_tiles = triton.cdiv(K, cfg.block_k)
    split = max(1, min(cfg.split_k, k_tiles))
    k_per_split = triton.cdiv(k_tiles, split) * cfg.block_k
    split = triton.cdiv(K, k_per_split)
    even_k = K % cfg.block_k == 0
    if split == 1:
        dst, stride_s = out, 0
    else:
        dst = torch.empty(split, M, N, dtype=torch.float32, device=x2.device)
        stride_s = dst.stride(0)
    b = bias if bias is not None else weight
    r = residual if residual is not None else x2
    ro = residual_out if residual_out is not None else x2
    nw = norm_weight if norm_weight is not None else weight
    ss = sumsq if sumsq is not None else nw
    n_ss = sumsq.numel() if sumsq is not None else 1
    trigger, wait, pdl = pdl_launch(pdl_trigger, pdl_wait, x2.device)
    preload = (wait and pdl_preload and M == 1 and not cfg.use_dot and split == 1 and even_k
               and prologue in (PRO_NONE, PRO_RMSNORM_SUMSQ) and N % rows_per_program == 0)
    _gemv_kernel[(triton.cdiv(N, rows_per_program), split)](
        x2, weight, b, dst, M, N, K, k_per_split, x2.stride(0), weight.stride(0), dst.stride(-2), stride_s,
        r, nw, ro, r.stride(0), ro.stride(0), float(eps), up_offset, ss, n_ss,
        HAS_BIAS=bias is not None, SPLIT=split, USE_DOT=cfg.use_dot, EVEN_N=N % rows_per_program == 0,
        EVEN_K=even_k, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_UPCAST=dot_upcast(x2.dtype),
        PRO=prologue, HAS_RES=residual is not None and epilogue != EPI_ADD_SUMSQ,
        WRITE_RES=residual_out is not None, EPI=epilogue, SS_BLOCK=triton.next_power_of_2(n_ss),
        TRIGGER=trigger if split == 1 else 0, WAIT=wait and not preload, PRELOAD=preload, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl,
    )
    if split > 1:
        block = 1024
        _splitk_reduce_kernel[(M, triton.cdiv(N, block))](dst, b, out, M, N, out.stride(0), SPLIT=split,
                                                          HAS_BIAS=bias is not None, BLOCK=block,
                                                          TRIGGER=1 if trigger else 0,
                                                          num_warps=4)
    return out


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The twin (and the competitor the tuner times): torch's own linear."""
    return torch.nn.functional.linear(x, weight, bias)


# ---------------------------------------------------------------------------------------------------------------------
# Measure and pick (FlashDecoding++'s heuristic, decided on the running device)
# ---------------------------------------------------------------------------------------------------------------------
_TORCH = "torch"
_choices: dict[tuple, GemvConfig | str] = {}


def _m_bucket(m: int) -> int:
    b = 1
    while b < m:
        b *= 2
    return b


def choose(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> GemvConfig | str:
    """The implementation ``linear`` uses for this shape: a GemvConfig or "torch". Times the candidates the first
    time a (M bucket, N, K, dtype, bias) key is seen; never times inside a CUDA-graph capture."""
    M = x.numel() // x.shape[-1]
    key = (_m_bucket(M), weight.shape[0], weight.shape[1], x.dtype, bias is not None, x.device)
    pick = _choices.get(key)
    if pick is not None:
        return pick
    forced = os.environ.get("ROOFLM_GEMV", "auto")
    if forced == "off":
        return _TORCH
    if torch.cuda.is_current_stream_capturing():
        return _TORCH  # no timing inside a capture; the runner warms up every bucket eagerly first
    mb = key[0]
    xs = torch.randn(mb, weight.shape[1], dtype=x.dtype, device=x.device)
    copies = weight_copies(weight)
    results: list[tuple[float, GemvConfig | str]] = [
        (time_in_graph(lambda w: linear_ref(xs, w, bias), copies, x.device), _TORCH)]
    for cfg in CANDIDATES:
        if cfg.supports(mb):
            results.append((time_in_graph(lambda w, c=cfg: gemv(xs, w, bias, c), copies, x.device), cfg))
    del copies
    results.sort(key=lambda r: r[0])
    pick = results[0][1]
    if forced == "verbose":
        print(f"[rooflm.gemv] M<={mb} N={weight.shape[0]} K={weight.shape[1]}: "
              + ", ".join(f"{c if isinstance(c, str) else _short(c)}={t * 1e3:.1f}us" for t, c in results))
    _choices[key] = pick
    return pick


def _short(c: GemvConfig) -> str:
    return f"{'dot' if c.use_dot else 'sum'}{c.block_n}x{c.block_k}s{c.split_k}w{c.num_warps}"


def choices() -> dict[tuple, GemvConfig | str]:
    """What was picked so far, for reports: {(M bucket, N, K, dtype, has_bias, device): config or "torch"}."""
    return dict(_choices)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias through the fastest measured implementation for this shape (CUDA, at most 16 rows);
    torch's linear otherwise."""
    M = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (not x.is_cuda or interpreting() or M < 1 or M > MAX_M or weight.dtype != x.dtype
            or x.dtype not in (torch.float16, torch.bfloat16) or weight.stride(-1) != 1 or weight.dim() != 2):
        return linear_ref(x, weight, bias)
    pick = choose(x, weight, bias)
    if pick == _TORCH or not pick.supports(M):
        return linear_ref(x, weight, bias)
    return gemv(x, weight, bias, pick)
