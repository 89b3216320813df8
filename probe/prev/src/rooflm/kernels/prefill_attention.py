# Prefill / extend attention over the paged KV cache: causal, with a cached prefix and an optional sliding window.
#
# Technique: FlashAttention (Dao et al. 2022; FlashAttention-2, Dao 2023): a program owns a BLOCK_M tile of one
# sequence's queries for one head, streams the context in BLOCK_N tiles and keeps an online softmax (running max
# m_i, running sum l_i, rescaled accumulator) so the [q_len, seq_len] score matrix never reaches memory. The context
# is read through the block table (PagedAttention, Kwon et al. 2023), which covers a cached prefix (prefix-cache hits,
# chunked prefill) as well as the new tokens: the new tokens' K/V are written into the cache first.
#
# Shapes and invariants (see rooflm/attention/backend.py):
#   q               [num_tokens, num_heads, head_dim], sequence i's queries are rows query_start_loc[i]:[i+1]
#   kv_cache        [2, num_blocks, block_size, num_kv_heads, head_dim]; or a QuantizedKVCache (int8 / fp8 values +
#                   float32 scales [2, num_blocks, block_size, num_kv_heads]): K tiles enter the product as they are
#                   (int8 and e4m3 values are exact in fp16 / bf16) and their per-token scales multiply the scores,
#                   V tiles are dequantized in registers. The step's own new tokens are read back from the cache,
#                   so a chunked or prefix-cached prefill sees the same (dequantized) K/V as a one-shot prefill.
#   query_start_loc [num_seqs + 1] int32; seq_lens [num_seqs] int32; block_tables [num_seqs, max_blocks] int32
#   query j of sequence i sits at position seq_lens[i] - q_len_i + j; it sees key positions p with
#   p <= its position and, with a window W, p > its position - W.
#   TREE (token-tree verification, SpecInfer / Medusa): tree_offsets [num_seqs] int32 and tree_data [n] int8. A
#   sequence with tree_offsets[i] = o >= 0 has its [q_len, q_len] mask row-major at tree_data[o:]: among the step's
#   new keys (positions >= ctx_len) query j sees new key k only if mask[j, k] != 0, whatever their order; the cached
#   context before them follows the causal / window rule. tree_offsets[i] = -1: plain causal. One block per tree
#   sequence rather than a bitmask per row, so any tree size works and plain sequences (long prefill chunks in the same
#   batch) cost nothing; the masks reach the kernel as device tensors only (the launch reads no host copy of them).
# Grid: (cdiv(max_query_len, BLOCK_M), num_heads, num_seqs); tiles past a sequence's query length exit at once.
# GQA: query head h reads KV head h // (num_heads // num_kv_heads); K/V are never repeated in memory.
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rooflm.attention.kv_quant import QuantizedKVCache
from rooflm.attention.tree_mask import PackedTreeMasks
from rooflm.kernels._tl import dot, dot_upcast
from rooflm.kernels._utils import check_last_dim_contiguous, next_pow2

_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, tree_off_ptr, tree_ptr,
    qk_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_sb, stride_ss, stride_sh,  # KV_QUANT: the scales' strides (block, slot in block, kv head)
    stride_bt,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    KV_QUANT: tl.constexpr,
    TREE: tl.constexpr,
):
    mblk = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if mblk * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # tokens before this step's first query
    kvh = head // GROUP

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_m = offs_m < q_len
    mask_d = offs_d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, D]
    q_pos = ctx_len + offs_m  # [BLOCK_M]

    # Key range this tile can see: up to its last query's position; from its first query's window start.
    hi = tl.minimum(seq_len, ctx_len + (mblk + 1) * BLOCK_M)
    lo = tl.where(window > 0, tl.maximum(ctx_len + mblk * BLOCK_M - window + 1, 0), 0)
    tree_off = 0
    tree_from = seq_len  # keys at and after this position follow the tree mask: none for a causal sequence
    if TREE:  # a tree mask may open any of the new keys: scan them all (a tree is a few dozen tokens)
        tree_off = tl.load(tree_off_ptr + seq)
        is_tree = tree_off >= 0
        tree_off = tl.maximum(tree_off, 0)
        tree_from = tl.where(is_tree, ctx_len, seq_len)
        hi = tl.where(is_tree, seq_len, hi)
        lo = tl.where(is_tree, tl.minimum(lo, ctx_len), lo)
    lo = (lo // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    bt_row = block_tables_ptr + seq * stride_bt
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        row = blk * stride_kb + (offs_n % BLOCK_SIZE) * stride_ks + kvh * stride_kh
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D]
        v = tl.load(v_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # issued with K
        if KV_QUANT:
            srow = blk * stride_sb + (offs_n % BLOCK_SIZE) * stride_ss + kvh * stride_sh
            k_sc = tl.load(ks_ptr + srow, mask=mask_n, other=0.0)  # [BLOCK_N]
            v_sc = tl.load(vs_ptr + srow, mask=mask_n, other=0.0)
            # exact (through float32: Triton 3.9's interpreter converts int8 -> bfloat16 wrongly); the scale
            # multiplies the scores
            k = k.to(tl.float32).to(q.dtype)
            v = (v.to(tl.float32) * v_sc[:, None]).to(q.dtype)
        s = dot(q, tl.trans(k), DOT_UPCAST) * qk_scale  # [BLOCK_M, BLOCK_N]
        if KV_QUANT:
            s = s * k_sc[None, :]
        allowed = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        allowed = allowed & ((window <= 0) | (offs_n[None, :] > q_pos[:, None] - window))
        if TREE:
            new_k = offs_n - ctx_len  # index among the step's new tokens (< 0: cached context)
            in_tree = (offs_n >= tree_from) & mask_n  # [BLOCK_N]
            t = tl.load(tree_ptr + tree_off + offs_m[:, None] * q_len + new_k[None, :],
                        mask=mask_m[:, None] & in_tree[None, :], other=0)
            allowed = tl.where(in_tree[None, :], t != 0, allowed)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at zero
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_UPCAST)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    acc = acc / l_safe[:, None]
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def _default_tiles(head_dim_pad: int, max_query_len: int, on_cuda: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    if not on_cuda:
        return 16, 16, 4, 1  # the interpreter: small tiles keep the CPU tests fast
    if max_query_len <= 16:
        return 16, 64, 4, 2
    if head_dim_pad <= 64:
        return 128, 64, 4, 3
    if head_dim_pad <= 128:
        return 64, 64, 4, 3  # fastest of 7 tilings at 2048 tokens, D = 128 on an H200 (kernels/bench.py)
    return 64, 32, 8, 2


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor | QuantizedKVCache,  # [2, num_blocks, block_size, num_kv_heads, head_dim], new K/V written
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    tiles: tuple[int, int, int, int] | None = None,
    tree: PackedTreeMasks | None = None,
) -> torch.Tensor:
    """``tree``: token-tree masks of some sequences (``rooflm.attention.tree_mask.pack_tree_masks``); None: all
    causal."""
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, cache_dim = kv_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit kv_cache {tuple(kv_cache.shape)}")
    check_last_dim_contiguous("q", q)
    quant = isinstance(kv_cache, QuantizedKVCache)
    data = kv_cache.data if quant else kv_cache
    check_last_dim_contiguous("kv_cache", data)
    if out is None:
        out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    head_dim_pad = max(16, next_pow2(head_dim))
    block_m, block_n, warps, stages = tiles or _default_tiles(head_dim_pad, max_query_len, q.is_cuda)
    k_cache, v_cache = data[0], data[1]
    k_sc, v_sc = (kv_cache.scales[0], kv_cache.scales[1]) if quant else (k_cache, v_cache)  # unread unless quant
    if tree is not None and tree.offsets.shape[0] != num_seqs:
        raise ValueError(f"tree.offsets has {tree.offsets.shape[0]} entries for {num_seqs} sequences")
    tree_off, tree_data = (tree.offsets, tree.data) if tree is not None else (seq_lens, seq_lens)  # unread unless tree
    grid = (triton.cdiv(max_query_len, block_m), num_heads, num_seqs)
    _prefill_kernel[grid](
        q, k_cache, v_cache, k_sc, v_sc, out, query_start_loc, seq_lens, block_tables, tree_off, tree_data,
        float(scale) * _LOG2E, int(sliding_window or 0),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *((k_sc.stride(0), k_sc.stride(1), k_sc.stride(2)) if quant else (0, 0, 0)), block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_UPCAST=dot_upcast(q.dtype), KV_QUANT=quant, TREE=tree is not None,
        num_warps=warps,
        num_stages=stages,
    )
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor, kv_cache: torch.Tensor | QuantizedKVCache, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    block_tables: torch.Tensor, scale: float, sliding_window: int | None = None,
    tree_masks: list[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """The twin: per sequence, gather the context and run masked float32 attention (``attention.torch_ref``);
    ``tree_masks``: per sequence None or its [q_len, q_len] bool token-tree mask."""
    from rooflm.attention.torch_ref import attend, gather_context

    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        s, e = starts[i], starts[i + 1]
        if e > s:
            k, v = gather_context(kv_cache, block_tables[i], seq_len)
            out[s:e] = attend(q[s:e], k, v, scale, sliding_window, tree_masks[i] if tree_masks else None)
    return out
