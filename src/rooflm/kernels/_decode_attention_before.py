# Paged decode attention with split-KV parallelism and grouped-query heads.
#
# Technique: FlashDecoding (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference"): at decode a
# sequence has one query token, so one program per (sequence, head) leaves most of the GPU idle when the batch is
# small. The context is split into NUM_SPLITS chunks handled by separate programs, each keeps an online softmax
# (FlashAttention, Dao et al. 2022) over its chunk and writes a partial output and its log-sum-exp; a second kernel
# rescales and sums the partials. The paged layout follows PagedAttention (Kwon et al. 2023, vLLM).
#
# GQA without repeating K/V: one program owns one *KV head* and all GROUP = num_heads // num_kv_heads query heads
# that share it, so each K/V tile is loaded once and used by every head of the group (the group is the M dimension
# of tl.dot, padded to 16 rows).
#
# Shapes and invariants:
#   q            [num_seqs, num_heads, head_dim]        one new token per sequence (its K/V already in the cache)
#   kv_cache     [2, num_blocks, block_size, num_kv_heads, head_dim], last dim contiguous
#   block_tables [num_seqs, max_blocks] int32;  seq_lens [num_seqs] int32 (0 allowed: padded rows of a CUDA graph)
#   out          [num_seqs, num_heads, head_dim]
# Query of sequence i sits at position seq_lens[i] - 1 and sees positions [max(0, seq_len - window), seq_len).
# The kernel reads no host value that changes between steps (only num_splits, chosen from the batch shape), so a
# decode step that calls it can be captured in a CUDA graph and replayed at any context length. num_splits is a
# runtime argument (one compile serves every batch size). The partials are combined by a second small kernel; with
# fused_reduce=True the last split program of each (sequence, KV head) does it instead (an atomic ticket, one launch),
# which measured slower on an H200 (14.4 against 13.1 us per layer at batch 1, 1152 tokens), so it is off by default.
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from rooflm.kernels._tl import dot, dot_upcast
from rooflm.kernels._utils import check_last_dim_contiguous, device_sms, next_pow2

_LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr,  # DIRECT: [num_seqs, num_heads, head_dim] in q's dtype; else partials [num_seqs, num_heads, S, D] fp32
    lse_ptr,  # [num_seqs, num_heads, NUM_SPLITS] fp32, log2 domain (unused when DIRECT)
    final_ptr,  # FUSED_REDUCE: [num_seqs, num_heads, head_dim] in q's dtype
    counter_ptr,  # FUSED_REDUCE: [num_seqs * num_kv_heads] int32, zero between launches
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window in positions; 0 = none
    stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,  # cache strides: block, slot in block, kv head (shared by K and V)
    stride_bt,
    stride_os, stride_oh, stride_osplit,
    stride_fs, stride_fh,
    num_splits,
    DIRECT: tl.constexpr,
    FUSED_REDUCE: tl.constexpr, SPLITS_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (page)
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    start = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    span = seq_len - start
    chunk = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
    lo = start + split * chunk
    hi = tl.minimum(lo + chunk, seq_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # [GROUP_PAD, HEAD_DIM_PAD]

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    bt_row = block_tables_ptr + seq * stride_bt
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        row = blk * stride_kb + (offs_n % BLOCK_SIZE) * stride_ks + kvh * stride_kh  # [BLOCK_N]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D]
        v = tl.load(v_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # issued with K
        s = dot(q, tl.trans(k), DOT_UPCAST) * qk_scale  # [GROUP_PAD, BLOCK_N]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_UPCAST)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    acc = acc / l_safe[:, None]
    o_mask = mask_g[:, None] & mask_d[None, :]
    if DIRECT:
        o = out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        o = out_ptr + seq * stride_os + heads[:, None] * stride_oh + split * stride_osplit + offs_d[None, :]
        tl.store(o, acc, mask=o_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        lse_rows = lse_ptr + (seq * (GROUP * tl.num_programs(1)) + heads) * num_splits
        tl.store(lse_rows + split, lse, mask=mask_g)
        if FUSED_REDUCE:
            # The last of this (sequence, KV head)'s split programs to finish combines all the partials, so no
            # second kernel is launched (the "last block" pattern of CUDA's threadFenceReduction sample): every
            # thread's stores precede the barrier, the ticket's release orders them before the count, and the
            # acquire of the last ticket orders the reads below after every other program's stores.
            tl.debug_barrier()
            counter = counter_ptr + seq * tl.num_programs(1) + kvh
            ticket = tl.atomic_add(counter, 1, sem="acq_rel")
            if ticket == num_splits - 1:
                offs_s = tl.arange(0, SPLITS_PAD)
                mask_s = offs_s < num_splits
                for g in tl.static_range(GROUP):  # each head of the group: all its splits in one load
                    h = kvh * GROUP + g
                    lse_h = tl.load(lse_ptr + (seq * (GROUP * tl.num_programs(1)) + h) * num_splits + offs_s,
                                    mask=mask_s, other=float("-inf"), cache_modifier=".cg")
                    m_h = tl.max(lse_h, 0)
                    m_h = tl.where(m_h == float("-inf"), 0.0, m_h)
                    w = tl.exp2(lse_h - m_h)  # [SPLITS_PAD]
                    part = tl.load(out_ptr + seq * stride_os + h * stride_oh + offs_s[:, None] * stride_osplit
                                   + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :], other=0.0,
                                   cache_modifier=".cg")
                    den = tl.sum(w, 0)
                    res = tl.sum(part * w[:, None], 0) / tl.where(den > 0, den, 1.0)
                    tl.store(final_ptr + seq * stride_fs + h * stride_fh + offs_d,
                             res.to(final_ptr.dtype.element_ty), mask=mask_d)
                tl.atomic_xchg(counter, 0)  # ready for the next launch (and the next CUDA-graph replay)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    part_ptr, lse_ptr, out_ptr,
    stride_ps, stride_ph, stride_psplit,
    stride_os, stride_oh,
    num_heads, num_splits,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(lse_ptr + (seq * num_heads + head) * num_splits + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # an empty context (seq_len 0) gives zeros, never NaN
    w = tl.exp2(lse - m)  # [SPLITS_PAD]
    part = tl.load(part_ptr + seq * stride_ps + head * stride_ph + offs_s[:, None] * stride_psplit + offs_d[None, :],
                   mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    num = tl.sum(part * w[:, None], 0)
    den = tl.sum(w, 0)
    den = tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d, (num / den).to(out_ptr.dtype.element_ty),
             mask=mask_d)


_counters: dict[torch.device, torch.Tensor] = {}


def _counter_buffer(device: torch.device, n: int) -> torch.Tensor | None:
    """Zeroed int32 tickets for the fused reduction, kept per device (each launch leaves them at zero). None inside
    a CUDA-graph capture when the buffer would have to grow there (the caller then uses the reduce kernel)."""
    buf = _counters.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _counters[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return buf


def default_num_splits(num_seqs: int, num_kv_heads: int, num_sms: int, max_splits: int = 16) -> int:
    """Enough (sequence, KV head, split) programs for about two waves over the multiprocessors. Depends on the
    batch shape only, so a captured CUDA graph keeps its value for every context length."""
    programs = max(1, num_seqs * num_kv_heads)
    return max(1, min(max_splits, math.ceil(2 * num_sms / programs)))


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    fused_reduce: bool = False,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    num_seqs, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, cache_dim = kv_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit kv_cache {tuple(kv_cache.shape)}")
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("kv_cache", kv_cache)
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, device_sms(q))
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    head_dim_pad = max(16, next_pow2(head_dim))
    if block_n is None:
        block_n = 64 if head_dim_pad <= 128 else 32
    group_pad = max(16, next_pow2(group))
    qk_scale = float(scale) * _LOG2E
    window = int(sliding_window or 0)
    direct = num_splits == 1
    if direct:
        part, lse = out, out  # lse unused
        strides_o = (out.stride(0), out.stride(1), 0)
    else:
        part = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
        strides_o = (part.stride(0), part.stride(1), part.stride(2))
    counters = _counter_buffer(q.device, num_seqs * num_kv_heads) if fused_reduce and not direct else None
    fused = counters is not None
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part, lse, out, counters if fused else seq_lens, qk_scale,
        window,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        *strides_o, out.stride(0), out.stride(1), num_splits,
        DIRECT=direct, FUSED_REDUCE=fused, SPLITS_PAD=max(16, next_pow2(num_splits)), BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=group_pad,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_N=block_n, DOT_UPCAST=dot_upcast(q.dtype),
        num_warps=4, num_stages=2,
    )
    if not direct and not fused:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part, lse, out, part.stride(0), part.stride(1), part.stride(2), out.stride(0), out.stride(1), num_heads,
            num_splits, SPLITS_PAD=max(16, next_pow2(num_splits)), HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad, num_warps=4,
        )
    return out


def paged_decode_attention_ref(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The twin: gather each sequence's context and run float32 softmax attention (``attention.torch_ref``)."""
    from rooflm.attention.torch_ref import attend, gather_context

    out = torch.zeros_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        k, v = gather_context(kv_cache, block_tables[i], seq_len)
        out[i : i + 1] = attend(q[i : i + 1], k, v, scale, sliding_window)
    return out
