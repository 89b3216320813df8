"""Reference attention over the paged KV cache in plain torch: the CPU path and the oracle for every GPU kernel.

Obviously correct, not fast: for each sequence it gathers the context from the block table and runs masked softmax
attention in float32. A quantized cache (``QuantizedKVCache``) is dequantized to float32 as its blocks are gathered.
"""
from __future__ import annotations

import torch

from rooflm.attention.backend import AttentionMetadata, rotary_write_then_attend, write_kv_cache
from rooflm.attention.kv_quant import KVCache, gather_blocks
from rooflm.layers.rotary import apply_rotary


def gather_context(kv_cache: KVCache, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one sequence's first ``seq_len`` positions: each [seq_len, num_kv_heads, head_dim] (float32
    when the cache is quantized)."""
    block_size = kv_cache.shape[2]
    n_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[:n_blocks].long()
    k = gather_blocks(kv_cache, 0, blocks).reshape(-1, *kv_cache.shape[3:])[:seq_len]
    v = gather_blocks(kv_cache, 1, blocks).reshape(-1, *kv_cache.shape[3:])[:seq_len]
    return k, v


def attend(
    q: torch.Tensor,  # [q_len, num_heads, head_dim]: the last q_len positions of the context
    k: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    v: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    scale: float,
    sliding_window: int | None = None,
    tree: torch.Tensor | None = None,  # [q_len, q_len] bool: which new tokens each new token sees (a token tree)
) -> torch.Tensor:  # [q_len, num_heads, head_dim]
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    kf = k.float().repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale  # [num_heads, q_len, seq_len]
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
    k_pos = torch.arange(seq_len, device=q.device)[None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    if tree is not None:
        allowed = torch.cat([allowed[:, :seq_len - q_len], tree.to(allowed.device)], dim=1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vf).to(q.dtype)


def attend_decode_batched(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]: one new token per sequence, already in the cache
    kv_cache: KVCache,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor,  # [num_seqs]
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Decode attention for a whole batch in a handful of tensor ops (the per-sequence loop costs ~10 small ops per
    sequence and layer). Same maths as ``attend``: checked against it in the tests."""
    num_seqs, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    max_len = block_tables.shape[1] * block_size
    tables = block_tables.long()
    k = gather_blocks(kv_cache, 0, tables).reshape(num_seqs, max_len, num_kv_heads, head_dim).float()  # [S, L, Hkv, D]
    v = gather_blocks(kv_cache, 1, tables).reshape(num_seqs, max_len, num_kv_heads, head_dim).float()
    qg = q.float().view(num_seqs, num_kv_heads, group, head_dim)  # GQA: no K/V repeat
    scores = torch.einsum("shgd,slhd->shgl", qg, k) * scale  # [S, Hkv, G, L]
    k_pos = torch.arange(max_len, device=q.device)[None, :]
    last = (seq_lens.long() - 1)[:, None]  # the query's position
    allowed = k_pos <= last
    if sliding_window is not None:
        allowed &= k_pos > last - sliding_window
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("shgl,slhd->shgd", probs, v)  # [S, Hkv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


class TorchRefAttention:
    """The reference backend (see ``AttentionBackend``). Any device; its ``attend`` reads host copies of the
    metadata and checks the slots on the host, so a step through it cannot be captured in a CUDA graph."""

    name = "torch"
    programmatic_launch = False
    rotary_write_attend = rotary_write_then_attend

    def rotary_and_write(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns new rotated tensors (the inputs are left as they are)."""
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        return q, k

    def attend(
        self,
        q: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        k: torch.Tensor | None = None,  # accepted for the protocol; the reference reads the cache
        v: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if meta.is_decode_only and meta.num_seqs > 1 and meta.tree_masks is None:
            return attend_decode_batched(q, kv_cache, meta.block_tables, meta.seq_lens, scale, sliding_window)
        out = torch.empty_like(q)
        starts = meta.query_start_loc_cpu
        for i, seq_len in enumerate(meta.seq_lens_cpu):
            s, e = starts[i], starts[i + 1]
            if e == s:
                continue
            kc, vc = gather_context(kv_cache, meta.block_tables[i], seq_len)
            tree = meta.tree_masks[i] if meta.tree_masks is not None else None
            out[s:e] = attend(q[s:e], kc, vc, scale, sliding_window, tree)
        return out
