# Paged decode attention with split-KV parallelism and grouped-query heads.
#
# Technique: FlashDecoding (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference"): at decode a
# sequence has one query token, so one program per (sequence, head) leaves most of the GPU idle when the batch is
# small. The context is split over NUM_SPLITS programs, each keeps an online softmax (FlashAttention, Dao et al.
# 2022) over its tiles and writes a partial output and its log-sum-exp; a second kernel rescales and sums the
# partials. The paged layout follows PagedAttention (Kwon et al. 2023, vLLM).
#
# Why it is shaped the way it is (batch 1, 1k tokens, Llama-2-7B: 16 MiB of K/V per layer, 5.6 us at the 3.0 TB/s
# an H100 copies at; a plain 16 MiB streaming read takes 6.95 us in a CUDA graph there, so a single short kernel
# tops out near 80% of the copy bandwidth at this size; this kernel measured 11.5 us, 49%, against 13.2 us, 42.5%,
# for the previous one-chunk-per-split version):
# - Enough programs to keep every multiprocessor busy in one wave: at batch 1 a program owns ~1-2 tiles, so the time
#   is one chain of dependent memory round trips (sequence length -> block table -> K/V) plus the bytes. Split s owns
#   tiles s, s + S, s + 2S, ... (interleaved, not one contiguous chunk), so without a sliding window a program's first
#   tile does not depend on the sequence length: its block-table entries are loaded at once, in parallel with the
#   length, which removes one round trip from the chain; each later tile's entries are prefetched one tile ahead.
# - MHA (GROUP == 1) needs no tl.dot: padding one query row to the 16 rows of an MMA wastes the tensor cores and,
#   worse, routes K and V through shared memory to reach the MMA operand layout. The dot-free path computes
#   q . k with elementwise products and a sum over head_dim (a reduction among the 16 lanes that hold one 256-byte
#   row), and keeps the online softmax per tile row ("lane"): a running max, sum and [BLOCK_N, head_dim] accumulator
#   for each row, so the loop has no cross-warp reduction at all; the rows are merged once at the end with the same
#   log-sum-exp rule as the splits.
# - GQA without repeating K/V: one program owns one *KV head* and all GROUP = num_heads // num_kv_heads query heads
#   that share it, so each K/V tile is loaded once and used by every head of the group (the group is the M dimension
#   of tl.dot, padded to 16 rows).
# - Programmatic dependent launch (Hopper, PTX griddepcontrol), when pdl=True: the split kernel may start while the
#   kernel before it drains, loading sequence lengths and block-table entries before it waits (griddepcontrol.wait)
#   for that kernel's writes, and only then reads q and the cache; the reduce kernel starts early in the same way and
#   waits before it reads the partials. So with pdl=True, seq_lens and block_tables must not be written by the kernel
#   launched immediately before (q and kv_cache may be: that is where rotary embedding writes them).
#
# Shapes and invariants:
#   q            [num_seqs, num_heads, head_dim]        one new token per sequence (its K/V already in the cache, or,
#                                                       with NewTokenKV, q and the token's K/V handed over unrotated:
#                                                       the program that owns the last position uses its K/V from
#                                                       registers and writes them into the cache after its loop)
#   kv_cache     [2, num_blocks, block_size, num_kv_heads, head_dim], last dim contiguous; or a QuantizedKVCache
#                (int8 / fp8 values + float32 scales [2, num_blocks, block_size, num_kv_heads]): a K tile is used as
#                is (int8 and e4m3 values are exact in fp16 / bf16) and its per-token scales multiply the scores; a
#                V tile is dequantized in registers before the product with the probabilities
#   block_tables [num_seqs, max_blocks] int32;  seq_lens [num_seqs] int32 (0 allowed: padded rows of a CUDA graph)
#   out          [num_seqs, num_heads, head_dim]
# Query of sequence i sits at position seq_lens[i] - 1 and sees positions [max(0, seq_len - window), seq_len).
# The kernel reads no host value that changes between steps (only num_splits, chosen from the batch shape), so a
# decode step that calls it can be captured in a CUDA graph and replayed at any context length. num_splits is a
# runtime argument (one compile serves every batch size). With fused_reduce=True the last split program of each
# (sequence, KV head) combines the partials instead of a second kernel (an atomic ticket, one launch): ~1 us faster
# for MHA at batch 1 with the step's token fused on an H200 (a tie in isolation on an H100, where the decode step
# still measured 0.5-0.9% shorter; ``default_plan``), but 5-6 us slower for GQA (the last program
# combines GROUP heads one after another), so only the dot-free MHA plan uses it (None: the plan's choice;
# ROOFLM_DECODE_FUSED_REDUCE=0 turns it off). pdl=True is the caller's choice: the Triton attention backend sets it
# for the one-kernel decode of one sequence (``programmatic_launch``), where the kernel before is the qkv projection,
# which lets it be scheduled as soon as all of its own programs have started (``pdl_trigger`` of
# ``rooflm.kernels.gemv.launch_gemv``), and o_proj after it is launched the same way and waits in place. On an H200
# (tests/gpu/decode_pdl_chain.py: Llama-2-7B's 32 layers at one row and 1k tokens, qkv -> attention -> o -> gate_up
# -> down in one CUDA graph) the chain took 3.712 ms with plain launches, 3.663 with attention launched so, 3.642
# with qkv triggering it, 3.622 with o_proj waiting in place and 3.611 with gate_up_proj after o_proj the same way
# (the projections after it are launched so too, each letting the next in late: rooflm/kernels/handoff_gemv.py).
# Loading the first K/V tile before the wait was tried too: no faster in the chain, and a differently compiled loop
# (not bit-equal).
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from rooflm.attention.kv_quant import QuantizedKVCache
from rooflm.kernels._tl import dot, dot_upcast, gdc_launch_dependents, gdc_wait, pdl_supported
from rooflm.kernels._utils import check_last_dim_contiguous, device_sms, next_pow2
from rooflm.kernels.decode_plan import DecodePlan, NewTokenKV, check_new_kv, default_plan
from rooflm.kernels.kv_cache import rope_rows, rope_tables

__all__ = ["DecodePlan", "NewTokenKV", "default_plan", "paged_decode_attention", "paged_decode_attention_ref",
           "pdl_supported"]

_LOG2E = 1.4426950408889634


@triton.jit
def _row_offsets(blk, offs_n, kvh, stride_kb, stride_ks, stride_kh, BLOCK_SIZE: tl.constexpr):
    return blk.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_ks + kvh * stride_kh


@triton.jit(do_not_specialize=["num_splits", "window"])
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr,  # DIRECT: [num_seqs, num_heads, head_dim] in q's dtype; else partials [num_seqs, num_heads, S, D] fp32
    lse_ptr,  # [num_seqs, num_heads, NUM_SPLITS] fp32, log2 domain (unused when DIRECT)
    final_ptr,  # FUSED_REDUCE: [num_seqs, num_heads, head_dim] in q's dtype
    counter_ptr,  # FUSED_REDUCE: [num_seqs * num_kv_heads] int32, zero between launches
    knew_ptr, vnew_ptr, cos_ptr, sin_ptr, slot_ptr,  # NEW_KV: the step's token (see NewTokenKV)
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window in positions (read only when HAS_WINDOW)
    max_tokens,  # block_tables.shape[1] * BLOCK_SIZE: the table entries that exist
    stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,  # cache strides: block, slot in block, kv head (shared by K and V)
    stride_sb, stride_ss, stride_sh,  # KV_QUANT: the scales' strides, the same three dimensions
    stride_bt,
    stride_os, stride_oh, stride_osplit,
    stride_fs, stride_fh,
    stride_kns, stride_knh, stride_vns, stride_vnh, stride_cos,
    num_splits,
    DIRECT: tl.constexpr,
    FUSED_REDUCE: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    USE_PDL: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (page)
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    USE_DOT: tl.constexpr,  # False only for GROUP == 1: the dot-free path, GROUP_PAD == 1
    LANES: tl.constexpr,  # dot-free: softmax state per tile row (no cross-warp reduction in the loop)
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    KV_QUANT: tl.constexpr,  # the cache holds int8 / fp8 values with per-(token, head) scales
    NEW_KV: tl.constexpr, ROPE_HALF: tl.constexpr,  # q and the new k unrotated, the new k and v not in the cache
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if USE_PDL:
        gdc_launch_dependents()  # the reduce kernel may be scheduled now; it waits for this grid before reading

    # Prologue: nothing here is written by the kernel launched just before (see the header), so with PDL it overlaps
    # that kernel's tail. The first tile's block-table entries do not depend on seq_len unless there is a window.
    seq_len = tl.load(seq_lens_ptr + seq)
    if HAS_WINDOW:
        start = tl.maximum(seq_len - window, 0)
    else:
        start = 0
    n_first = (start // BLOCK_N + split) * BLOCK_N
    step = BLOCK_N * num_splits
    bt_row = block_tables_ptr + seq * stride_bt
    arange_n = tl.arange(0, BLOCK_N)
    offs_n = n_first + arange_n
    blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=offs_n < max_tokens, other=0)
    if USE_PDL:
        gdc_wait()  # q and the cache may come from the previous kernel (rotary embedding + cache write)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q_rows = q_ptr + seq * stride_qs + heads[:, None] * stride_qh
    q_mask = mask_g[:, None] & mask_d[None, :]
    if NEW_KV:
        # The rotary kernel's work, done here (see NewTokenKV): q rotated by every program; the new k rotated and v
        # loaded by the program whose tiles hold the last position, which writes both into the cache at the end.
        last = seq_len - 1
        owner = (seq_len > 0) & ((last // BLOCK_N - start // BLOCK_N) % num_splits == split)
        cos, sin = rope_tables(cos_ptr + seq * stride_cos, sin_ptr + seq * stride_cos, offs_d, ROPE_HALF)
        q = rope_rows(q_rows, offs_d[None, :], q_mask, cos[None, :], sin[None, :], ROPE_HALF).to(q_ptr.dtype.element_ty)
        k_new = tl.zeros([HEAD_DIM_PAD], k_ptr.dtype.element_ty)
        v_new = tl.zeros([HEAD_DIM_PAD], v_ptr.dtype.element_ty)
        if owner:
            k_new = rope_rows(knew_ptr + seq * stride_kns + kvh * stride_knh, offs_d, mask_d, cos, sin, ROPE_HALF)
            k_new = k_new.to(k_ptr.dtype.element_ty)
            v_new = tl.load(vnew_ptr + seq * stride_vns + kvh * stride_vnh + offs_d, mask=mask_d, other=0.0)
            v_new = v_new.to(v_ptr.dtype.element_ty)
        slot = tl.load(slot_ptr + seq, mask=owner, other=-1).to(tl.int64)  # written after the loop
    else:
        q = tl.load(q_rows + offs_d[None, :], mask=q_mask, other=0.0)  # [GROUP_PAD, HEAD_DIM_PAD]

    if USE_DOT:
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    elif LANES:  # per-row ("lane") softmax state, merged after the loop
        qv = tl.sum(q.to(tl.float32), 0) * qk_scale  # [HEAD_DIM_PAD] (GROUP_PAD == 1)
        m_r = tl.full([BLOCK_N], float("-inf"), tl.float32)
        l_r = tl.zeros([BLOCK_N], tl.float32)
        acc_r = tl.zeros([BLOCK_N, HEAD_DIM_PAD], tl.float32)
    else:  # one softmax state for the head: scalar max and sum, [HEAD_DIM_PAD] accumulator
        qv = tl.sum(q.to(tl.float32), 0) * qk_scale
        m_s = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)
        l_s = tl.sum(tl.zeros([BLOCK_N], tl.float32), 0)
        acc_v = tl.zeros([HEAD_DIM_PAD], tl.float32)
    for n0 in range(n_first, seq_len, step):
        offs_n = n0 + arange_n
        mask_n = (offs_n < seq_len) & (offs_n >= start)
        row = _row_offsets(blk, offs_n, kvh, stride_kb, stride_ks, stride_kh, BLOCK_SIZE)  # [BLOCK_N]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D]
        v = tl.load(v_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # issued with K
        if NEW_KV:
            if n0 + BLOCK_N > last:  # the owner's last tile: its last row is not in the cache yet, use the registers
                is_new = offs_n == last
                k = tl.where(is_new[:, None], k_new[None, :], k)
                v = tl.where(is_new[:, None], v_new[None, :], v)
        if KV_QUANT:
            srow = _row_offsets(blk, offs_n, kvh, stride_sb, stride_ss, stride_sh, BLOCK_SIZE)
            k_sc = tl.load(ks_ptr + srow, mask=mask_n, other=0.0)  # [BLOCK_N]
            v_sc = tl.load(vs_ptr + srow, mask=mask_n, other=0.0)
            # exact (through float32: Triton 3.9's interpreter converts int8 -> bfloat16 wrongly); the scale
            # multiplies the scores
            k = k.to(tl.float32).to(q.dtype)
            v = (v.to(tl.float32) * v_sc[:, None]).to(q.dtype)
        nxt = offs_n + step  # prefetch the next tile's block-table entries while K/V are in flight
        blk = tl.load(bt_row + nxt // BLOCK_SIZE, mask=nxt < seq_len, other=0)
        if USE_DOT:
            s = dot(q, tl.trans(k), DOT_UPCAST) * qk_scale  # [GROUP_PAD, BLOCK_N]
            if KV_QUANT:
                s = s * k_sc[None, :]
            s = tl.where(mask_n[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_UPCAST)
            m_i = m_new
        elif LANES:
            s = tl.sum(k.to(tl.float32) * qv[None, :], 1)  # [BLOCK_N]
            if KV_QUANT:
                s = s * k_sc
            s = tl.where(mask_n, s, float("-inf"))
            m_new = tl.maximum(m_r, s)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing stays at 0
            alpha = tl.exp2(m_r - m_ref)
            p = tl.exp2(s - m_ref)
            l_r = l_r * alpha + p
            acc_r = acc_r * alpha[:, None] + p[:, None] * v.to(tl.float32)
            m_r = m_new
        else:
            s = tl.sum(k.to(tl.float32) * qv[None, :], 1)  # [BLOCK_N]
            if KV_QUANT:
                s = s * k_sc
            s = tl.where(mask_n, s, float("-inf"))
            m_new = tl.maximum(m_s, tl.max(s, 0))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_s - m_ref)
            p = tl.exp2(s - m_ref)
            l_s = l_s * alpha + tl.sum(p, 0)
            acc_v = acc_v * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)
            m_s = m_new

    if not USE_DOT and not LANES:
        l_i = tl.zeros([GROUP_PAD], tl.float32) + l_s
        m_i = tl.zeros([GROUP_PAD], tl.float32) + m_s
        acc = acc_v[None, :]
    if not USE_DOT and LANES:  # merge the rows: the same rescale-and-sum as the split reduction
        m_all = tl.max(m_r, 0)
        m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
        w = tl.exp2(m_r - m_all)
        l_i = tl.zeros([GROUP_PAD], tl.float32) + tl.sum(l_r * w, 0)
        m_i = tl.zeros([GROUP_PAD], tl.float32) + m_all
        acc = tl.sum(acc_r * w[:, None], 0)[None, :]
    if NEW_KV:
        row_new = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_ks + kvh * stride_kh + offs_d
        write_mask = offs_d < tl.where(slot >= 0, HEAD_DIM, 0)  # slot is -1 unless this program owns the token
        tl.store(k_ptr + row_new, k_new, mask=write_mask)
        tl.store(v_ptr + row_new, v_new, mask=write_mask)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    acc = acc / l_safe[:, None]
    o_mask = mask_g[:, None] & mask_d[None, :]
    if DIRECT:
        o = out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        # an empty split writes only its lse (-inf); the reduction masks its partial, so it is never read
        o = out_ptr + seq * stride_os + heads[:, None] * stride_oh + split * stride_osplit + offs_d[None, :]
        tl.store(o, acc, mask=o_mask & ((n_first + 0 * offs_d[None, :]) < seq_len))
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
                for g in tl.static_range(GROUP):
                    h = kvh * GROUP + g
                    _combine(out_ptr + seq * stride_os + h * stride_oh,
                             lse_ptr + (seq * (GROUP * tl.num_programs(1)) + h) * num_splits,
                             final_ptr + seq * stride_fs + h * stride_fh, stride_osplit, num_splits,
                             SPLITS_PAD, HEAD_DIM, HEAD_DIM_PAD, True)
                tl.atomic_xchg(counter, 0)  # ready for the next launch (and the next CUDA-graph replay)


@triton.jit
def _combine(part_row, lse_row, out_row, stride_psplit, num_splits,
             SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BYPASS_L1: tl.constexpr):
    """out = sum_s 2^(lse_s - m) * part_s / sum_s 2^(lse_s - m) for one (sequence, head); splits with lse = -inf (no
    tokens) are masked out, so their partial rows may hold anything."""
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_d = offs_d < HEAD_DIM
    if BYPASS_L1:  # written by other programs of this launch: read through L2
        lse = tl.load(lse_row + offs_s, mask=offs_s < num_splits, other=float("-inf"), cache_modifier=".cg")
    else:
        lse = tl.load(lse_row + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    live = lse > float("-inf")
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # an empty context (seq_len 0) gives zeros, never NaN
    w = tl.where(live, tl.exp2(lse - m), 0.0)  # [SPLITS_PAD]
    p_mask = live[:, None] & mask_d[None, :]
    p_ptr = part_row + offs_s[:, None] * stride_psplit + offs_d[None, :]
    if BYPASS_L1:
        part = tl.load(p_ptr, mask=p_mask, other=0.0, cache_modifier=".cg")
    else:
        part = tl.load(p_ptr, mask=p_mask, other=0.0)
    num = tl.sum(part * w[:, None], 0)
    den = tl.sum(w, 0)
    den = tl.where(den > 0, den, 1.0)
    tl.store(out_row + offs_d, (num / den).to(out_row.dtype.element_ty), mask=mask_d)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    part_ptr, lse_ptr, out_ptr,
    stride_ps, stride_ph, stride_psplit,
    stride_os, stride_oh,
    num_heads, num_splits,
    USE_PDL: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    if USE_PDL:
        gdc_wait()  # the partials come from the split kernel, which may still be running
    _combine(part_ptr + seq * stride_ps + head * stride_ph, lse_ptr + (seq * num_heads + head) * num_splits,
             out_ptr + seq * stride_os + head * stride_oh, stride_psplit, num_splits,
             SPLITS_PAD, HEAD_DIM, HEAD_DIM_PAD, False)


_counters: dict[torch.device, torch.Tensor] = {}
_retired_counters: list[torch.Tensor] = []  # grown out of; still referenced by captured CUDA graphs


def _counter_buffer(device: torch.device, n: int) -> torch.Tensor | None:
    """Zeroed int32 tickets for the fused reduction, kept per device (each launch leaves them at zero). None inside
    a CUDA-graph capture when the buffer would have to grow there (the caller then uses the reduce kernel). A buffer
    that grows is never freed: CUDA graphs captured earlier keep writing to the old one."""
    buf = _counters.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if buf is not None:
            _retired_counters.append(buf)
        buf = _counters[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return buf


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv_cache: torch.Tensor | QuantizedKVCache,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    fused_reduce: bool | None = None,
    pdl: bool = False,
    use_dot: bool | None = None,
    lanes: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
    new_kv: NewTokenKV | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Decode attention over a paged KV cache. Arguments left at None come from ``default_plan`` (the batch shape).
    ``pdl`` launches with programmatic dependent launch where supported (see the module header for what it requires
    of the kernel launched just before); ``use_dot`` True forces tl.dot, False the dot-free loop (MHA only), whose
    softmax state is kept per tile row when ``lanes``. With ``new_kv`` q is unrotated and the last position's K/V are
    not in the cache yet (see ``NewTokenKV``)."""
    num_seqs, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, cache_dim = kv_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit kv_cache {tuple(kv_cache.shape)}")
    check_last_dim_contiguous("q", q)
    quant = isinstance(kv_cache, QuantizedKVCache)
    data = kv_cache.data if quant else kv_cache
    check_last_dim_contiguous("kv_cache", data)
    group = num_heads // num_kv_heads
    if use_dot is False and group > 1:
        raise ValueError(f"use_dot=False needs num_heads == num_kv_heads; got {num_heads} and {num_kv_heads}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if new_kv is not None:
        check_new_kv(new_kv, num_seqs, num_kv_heads, head_dim, quant)
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    plan = default_plan(num_seqs, num_kv_heads, group, device_sms(q))
    if num_splits is None:
        num_splits = plan.num_splits
    if use_dot is None:
        use_dot = plan.use_dot if num_splits == plan.num_splits else group > 1 or num_splits == 1
    if use_dot == plan.use_dot:
        block_n = block_n or (plan.block_n if head_dim <= 128 else min(plan.block_n, 32))
        num_warps = num_warps or plan.num_warps
        num_stages = num_stages or plan.num_stages
    if fused_reduce is None:
        fused_reduce = (plan.fused_reduce and use_dot == plan.use_dot and num_splits == plan.num_splits
                        and os.environ.get("ROOFLM_DECODE_FUSED_REDUCE", "1") != "0")
    use_pdl = bool(pdl) and pdl_supported(q.device)
    k_cache, v_cache = data[0], data[1]
    k_sc, v_sc = (kv_cache.scales[0], kv_cache.scales[1]) if quant else (k_cache, v_cache)  # unread unless quant
    head_dim_pad = max(16, next_pow2(head_dim))
    if block_n is None:
        block_n = 64 if head_dim_pad <= 128 else 32
    group_pad = max(16, next_pow2(group)) if use_dot else 1
    qk_scale = float(scale) * _LOG2E
    window = int(sliding_window or 0)
    direct = num_splits == 1
    splits_pad = max(16, next_pow2(num_splits))
    if direct:
        part, lse = out, out  # lse unused
        strides_o = (out.stride(0), out.stride(1), 0)
    else:
        part = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
        strides_o = (part.stride(0), part.stride(1), part.stride(2))
    counters = _counter_buffer(q.device, num_seqs * num_kv_heads) if fused_reduce and not direct else None
    fused = counters is not None
    launch = {"launch_pdl": True} if use_pdl else {}
    nk = new_kv
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, k_sc, v_sc, block_tables, seq_lens, part, lse, out, counters if fused else seq_lens,
        *((nk.k, nk.v, nk.cos, nk.sin, nk.slot_mapping) if nk else (q,) * 5),
        qk_scale, window, block_tables.shape[1] * block_size,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *((k_sc.stride(0), k_sc.stride(1), k_sc.stride(2)) if quant else (0, 0, 0)),
        block_tables.stride(0),
        *strides_o, out.stride(0), out.stride(1),
        *((nk.k.stride(0), nk.k.stride(1), nk.v.stride(0), nk.v.stride(1), nk.cos.stride(0)) if nk else (0,) * 5),
        num_splits,
        DIRECT=direct, FUSED_REDUCE=fused, SPLITS_PAD=splits_pad if fused else 1, HAS_WINDOW=window > 0,
        USE_PDL=use_pdl, BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=group_pad, USE_DOT=use_dot, LANES=lanes,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_N=block_n, DOT_UPCAST=dot_upcast(q.dtype),
        KV_QUANT=quant, NEW_KV=nk is not None, ROPE_HALF=nk.cos.shape[1] if nk else 1,
        num_warps=num_warps or 4, num_stages=num_stages or 2, **launch,
    )
    if not direct and not fused:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part, lse, out, part.stride(0), part.stride(1), part.stride(2), out.stride(0), out.stride(1), num_heads,
            num_splits, USE_PDL=use_pdl, SPLITS_PAD=splits_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            num_warps=4, **launch,
        )
    return out


def paged_decode_attention_ref(
    q: torch.Tensor, kv_cache: torch.Tensor | QuantizedKVCache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    new_kv: NewTokenKV | None = None,
) -> torch.Tensor:
    """The twin: gather each sequence's context and run float32 softmax attention (``attention.torch_ref``); with
    ``new_kv``, first the rotary twin that writes the cache."""
    from rooflm.attention.torch_ref import attend, gather_context

    if new_kv is not None:
        from rooflm.kernels.kv_cache import rotary_write_kv_cache_ref

        q, _ = rotary_write_kv_cache_ref(q, new_kv.k, new_kv.v, None, new_kv.cos, new_kv.sin, kv_cache,
                                         new_kv.slot_mapping)
    out = torch.zeros_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        k, v = gather_context(kv_cache, block_tables[i], seq_len)
        out[i : i + 1] = attend(q[i : i + 1], k, v, scale, sliding_window)
    return out
