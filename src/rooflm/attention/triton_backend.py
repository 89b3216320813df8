"""The GPU attention backend: Triton kernels over the paged KV cache (``rooflm.kernels``).

Same contract as ``TorchRefAttention`` (see ``attention/backend.py``), which is its oracle:
  1. write the step's new K/V into the cache at ``slot_mapping`` (one kernel, -1 slots skipped);
  2. a decode-only step (one query per sequence) runs split-KV paged decode attention (FlashDecoding): it reads only
     device tensors and a split count fixed by the batch shape, so the step can be captured in a CUDA graph;
  3. any other step (prefill, chunked prefill, prefix-cache hits, mixed batches) runs the paged prefill/extend
     kernel (FlashAttention-style, causal, cached prefix, optional sliding window).
GQA is handled inside the kernels; K/V are never repeated.
"""
from __future__ import annotations

import torch

from rooflm.attention.backend import AttentionMetadata
from rooflm.kernels.decode_attention import paged_decode_attention
from rooflm.kernels.kv_cache import rotary_write_kv_cache, write_kv_cache
from rooflm.kernels.prefill_attention import paged_prefill_attention


class TritonAttention:
    name = "triton"

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        kv_written: bool = False,  # True when the caller already wrote k/v (fused rotary + cache write)
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        if not kv_written:
            write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        return self.attend(q, kv_cache, meta, scale, sliding_window)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               sliding_window: int | None = None) -> torch.Tensor:
        """Attention over the cache only (the new K/V must already be in it)."""
        out = torch.empty_like(q)
        if meta.is_decode_only and meta.num_tokens == meta.num_seqs:
            return paged_decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, scale, sliding_window,
                                          out=out)
        return paged_prefill_attention(q, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                       meta.max_query_len, scale, sliding_window, out=out)

    @staticmethod
    def rotary_and_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                         is_neox: bool = True) -> None:
        """Rotate q and k in place and write k, v into the cache: one kernel (then call ``forward`` with
        ``kv_written=True``). cos, sin: [max_positions, rot_dim // 2]."""
        rotary_write_kv_cache(q, k, v, positions, cos, sin, kv_cache, meta.slot_mapping, is_neox)
