# Fused mixture-of-experts MLP: every token's top-k SwiGLU experts as two grouped GEMMs, with no host round trip.
#
# The reference (``rooflm.models.mixtral.moe_forward``) asks the GPU which experts were chosen and loops over them on
# the host: a sync per layer, so a decode step cannot be captured in a CUDA graph, and one small GEMM pair per expert.
# Here the (token, slot) pairs are grouped by expert on the device and each expert's group is padded to a multiple of
# BLOCK_M rows, so every BLOCK_M-row tile of the grouped list belongs to a single expert (the block-sparse layout of
# MegaBlocks, Gale et al. 2023, "MegaBlocks: Efficient Sparse Training with Mixture-of-Experts"; the same plan as
# vLLM's ``fused_moe``). A program multiplies one tile, its activation rows gathered by index, by one BLOCK_N slice of
# that tile's expert weight:
#
#   1. ``h = silu(x[pair // top_k] @ w1[e]^T) * (x[pair // top_k] @ w3[e]^T)``: gate and up are two accumulators of
#      the same program (w13 stacks [w1 | w3] by rows), and SiLU-and-multiply is its epilogue, so the [pairs, 2I]
#      intermediate is never written;
#   2. ``y[pair] = weight[pair] * (h[pair] @ w2[e]^T)``;
#   3. ``out[t] = sum over slots of y[t * top_k + slot]`` (a fixed order: the result does not depend on scheduling).
#
# Tiles past the last used one, padding rows and pairs routed to another rank's experts (expert parallelism) are
# masked; such a pair's ``y`` row is zero. The plan (``moe_align``) is built by one Triton program when the step is
# small (decode: one launch instead of a dozen torch ops) and by torch ops otherwise; both give the same plan.
#
# Roundings follow the reference: each projection's product is rounded to the activation dtype before SiLU-and-mul
# (as ``silu_mul_row`` in activation.py), the routing weight multiplies the float32 product of w2, and the top-k
# contributions are added in float32 and rounded once.
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rooflm.kernels._tl import dot, dot_upcast
from rooflm.kernels._utils import next_pow2

# One Triton program builds the plan while its [pairs, experts] one-hot matrix stays this small.
ALIGN_ONE_PROGRAM_MAX = 16384
# Up to this many (token, slot) pairs a step takes the decode tiles (16 rows).
DECODE_MAX_PAIRS = 64


@dataclass(frozen=True)
class MoEPlan:
    """The (token, slot) pairs grouped by local expert, each group padded to whole tiles of ``block_m`` rows."""

    sorted_pairs: torch.Tensor  # [num_blocks * block_m] int32: a pair index (token * top_k + slot); padding = pairs
    block_expert: torch.Tensor  # [num_blocks] int32: the local expert of each tile, -1 for a tile past the last
    block_m: int
    num_pairs: int


def max_blocks(num_pairs: int, num_local: int, block_m: int) -> int:
    """An upper bound on the tiles any routing needs: sum over experts of ceil(count / block_m) is at most the sum of
    floor(count / block_m), itself at most floor(pairs / block_m), plus one per expert that got any pair. The plan's
    stores rely on it (no index past the tiles)."""
    return num_pairs // block_m + min(num_local, num_pairs)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_pairs, expert_start, num_local, num_slots, num_blocks,
                  BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr,
                  BLOCK_B: tl.constexpr):
    p = tl.arange(0, BLOCK_P)
    e = tl.arange(0, BLOCK_E)
    valid = p < num_pairs
    local = tl.load(ids_ptr + p, mask=valid, other=-1).to(tl.int32) - expert_start
    mine = valid & (local >= 0) & (local < num_local)
    onehot = ((local[:, None] == e[None, :]) & mine[:, None]).to(tl.int32)  # [P, E]
    counts = tl.sum(onehot, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    rank = tl.sum(onehot * (tl.cumsum(onehot, axis=0) - 1), axis=1)  # earlier pairs of the same expert
    dest = tl.sum(onehot * starts[None, :], axis=1) + rank
    s = tl.arange(0, BLOCK_S)
    tl.store(sorted_ptr + s, tl.zeros([BLOCK_S], dtype=tl.int32) + num_pairs, mask=s < num_slots)  # padding
    tl.debug_barrier()  # the padding is written before any pair lands on it
    tl.store(sorted_ptr + dest, p, mask=mine)
    b = tl.arange(0, BLOCK_B)
    in_range = (e < num_local)[None, :]
    be = tl.sum(((ends[None, :] <= (b * BLOCK_M)[:, None]) & in_range).to(tl.int32), axis=1)  # experts ending before
    tl.store(block_expert_ptr + b, tl.where(be < num_local, be, -1), mask=b < num_blocks)


def _align_torch(ids: torch.Tensor, num_local: int, expert_start: int, block_m: int,
                 num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan from torch ops (any size; about a dozen launches, none of which waits on the host)."""
    num_pairs, dev = ids.numel(), ids.device
    local = ids.to(torch.int64) - expert_start
    bucket = torch.where((local >= 0) & (local < num_local), local, num_local)  # num_local: another rank's expert
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=dev).scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_local:] = 0
    ends = torch.cumsum(padded, 0)
    order = torch.sort(bucket, stable=True).indices
    grouped = bucket[order]
    rank = torch.arange(num_pairs, device=dev) - (torch.cumsum(counts, 0) - counts)[grouped]
    slots = num_blocks * block_m
    dest = torch.where(grouped < num_local, (ends - padded)[grouped] + rank, slots + rank)  # others: past the end
    sorted_pairs = torch.full((slots + num_pairs,), num_pairs, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(num_blocks, device=dev) * block_m
    be = torch.searchsorted(ends[:num_local].contiguous(), starts, right=True)
    return sorted_pairs[:slots], torch.where(be < num_local, be, -1).to(torch.int32)


def moe_align(topk_ids: torch.Tensor, num_local: int, expert_start: int = 0, block_m: int = 16,
              method: str = "auto") -> MoEPlan:
    """Group the pairs of ``topk_ids`` [T, top_k] (global expert ids) by the local experts [expert_start,
    expert_start + num_local); pairs of other experts are left out. Within an expert, pairs keep their order.
    ``method``: "triton" (one program), "torch", or "auto" (one program while it is small enough)."""
    if method not in ("auto", "triton", "torch"):
        raise ValueError(f"method={method!r} is invalid: expected 'auto', 'triton' or 'torch'")
    ids = topk_ids.reshape(-1)
    num_pairs = ids.numel()
    num_blocks = max_blocks(num_pairs, num_local, block_m)
    block_p, block_e = next_pow2(max(num_pairs, 1)), next_pow2(num_local)
    if method == "auto":
        method = "triton" if block_p * block_e <= ALIGN_ONE_PROGRAM_MAX else "torch"
    if method == "torch":
        sorted_pairs, block_expert = _align_torch(ids, num_local, expert_start, block_m, num_blocks)
    else:
        sorted_pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=ids.device)
        block_expert = torch.empty(num_blocks, dtype=torch.int32, device=ids.device)
        _align_kernel[(1,)](ids, sorted_pairs, block_expert, num_pairs, expert_start, num_local, num_blocks * block_m,
                            num_blocks, BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_E=block_e,
                            BLOCK_S=next_pow2(num_blocks * block_m), BLOCK_B=next_pow2(num_blocks), num_warps=4)
    return MoEPlan(sorted_pairs, block_expert, block_m, num_pairs)


@triton.jit
def _mm(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    if IEEE:  # float32 activations: full-precision products, not TF32
        r = tl.dot(a, b, input_precision="ieee")
    else:
        r = dot(a, b, UPCAST)
    return r


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, c_ptr, sorted_ptr, block_expert_ptr, weights_ptr, num_pairs, N, K,
                     stride_am, stride_we, stride_wn, stride_cm, gate_rows,
                     A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
                     UPCAST: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[pair, n] for one tile of pairs (one expert) and BLOCK_N columns: x rows gathered by pair // A_ROW_DIV times
    the expert's weight rows [n] (and, GATED, rows [gate_rows + n], for silu(gate) * up)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    a_rows = (pairs // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_base + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]: W^T's tile
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (offs_k + k0) < K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc += _mm(a, w, IEEE, UPCAST)
        if GATED:
            wu = tl.load(w_ptrs + gate_rows * stride_wn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc_up += _mm(a, wu, IEEE, UPCAST)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dt = c_ptr.dtype.element_ty
    if GATED:  # the roundings of silu_mul_row: gate and up in the activation dtype, silu(gate) rounded too
        g = acc.to(dt).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        acc = act * acc_up.to(dt).to(tl.float32)
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(dt), mask=row_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class MoEGemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def default_config(num_pairs: int, n: int, device: torch.device) -> MoEGemmConfig:
    """Few pairs (decode): 16-row tiles and narrow column slices, so each chosen expert's weight streams through
    many programs; many pairs (prefill): 64-row tiles that reuse each weight tile across tokens. ``n``: the
    product's output columns."""
    if device.type != "cuda":
        return MoEGemmConfig(16, 32, 32, 4, 1)  # the interpreter: small tiles keep CPU tests fast
    if num_pairs <= DECODE_MAX_PAIRS:
        return MoEGemmConfig(16, 32 if n <= 4096 else 64, 128, 4, 4)
    return MoEGemmConfig(64, 64, 64, 4, 3)


def _gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, plan: MoEPlan, cfg: MoEGemmConfig, n: int,
          a_row_div: int, gated: bool, weights: torch.Tensor | None) -> None:
    grid = (triton.cdiv(n, cfg.block_n), plan.block_expert.numel())
    _moe_gemm_kernel[grid](a, w, out, plan.sorted_pairs, plan.block_expert,
                           weights if weights is not None else plan.sorted_pairs, plan.num_pairs, n, a.shape[1],
                           a.stride(0), w.stride(0), w.stride(1), out.stride(0), n,
                           A_ROW_DIV=a_row_div, GATED=gated, MUL_WEIGHT=weights is not None,
                           IEEE=a.dtype == torch.float32, UPCAST=dot_upcast(a.dtype), BLOCK_M=cfg.block_m,
                           BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, expert_start: int = 0, num_experts: int | None = None,
              configs: tuple[MoEGemmConfig, MoEGemmConfig] | None = None) -> torch.Tensor:
    """The contract of ``rooflm.models.mixtral.moe_forward`` with SiLU as the gated activation: x [T, hidden]; w13
    [E_local, 2 * I, hidden] ([w1 | w3]); w2 [E_local, hidden, I]; topk_weights [T, top_k] (float32); topk_ids
    [T, top_k], global ids of ``num_experts`` experts (default: E_local), of which [expert_start, expert_start +
    E_local) are computed here. ``configs``: the tiles of the two products (default: ``default_config``'s; both must
    have the same ``block_m``). Returns [T, hidden] in x's dtype."""
    t, hidden = x.shape
    num_local, two_i, _ = w13.shape
    inter = two_i // 2
    if w13.shape[2] != hidden or tuple(w2.shape) != (num_local, hidden, inter):
        raise ValueError(f"fused_moe: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)}")
    if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("fused_moe: x, w13 and w2 must be contiguous in their last dimension")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"fused_moe: topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [{t}, top_k] for x {tuple(x.shape)}")
    top_k = topk_ids.shape[1]
    num_pairs = t * top_k
    if t == 0:
        return torch.empty(0, hidden, dtype=x.dtype, device=x.device)
    cfg1, cfg2 = configs or (default_config(num_pairs, inter, x.device), default_config(num_pairs, hidden, x.device))
    if cfg1.block_m != cfg2.block_m:
        raise ValueError(f"fused_moe: the two products' block_m differ ({cfg1.block_m}, {cfg2.block_m})")
    plan = moe_align(topk_ids, num_local, expert_start, cfg1.block_m)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _gemm(x, w13, h, plan, cfg1, inter, top_k, True, None)
    # Under expert parallelism a pair routed to another rank's expert is skipped, so its row must start at zero.
    partial = num_experts is not None and num_local < num_experts
    y = (torch.zeros if partial else torch.empty)(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _gemm(h, w2, y, plan, cfg2, hidden, 1, False, topk_weights.reshape(-1).to(torch.float32).contiguous())
    return y.view(t, top_k, hidden).sum(dim=1)  # accumulates in float32, rounds once
