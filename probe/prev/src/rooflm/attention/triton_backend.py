"""The GPU attention backend: Triton kernels over the paged KV cache (``rooflm.kernels``).

Same contract as ``TorchRefAttention`` (see ``attention/backend.py``), which is its oracle:
  1. ``rotary_and_write``: one kernel rotates q and k in place and writes k, v into the cache at ``slot_mapping``
     (-1 slots skipped);
  2. ``attend``: a decode-only step (one query per sequence) runs split-KV paged decode attention (FlashDecoding):
     it reads only device tensors and a split count fixed by the batch shape, so the step can be captured in a CUDA
     graph; any other step (prefill, chunked prefill, prefix-cache hits, mixed batches) runs the paged prefill/extend
     kernel (FlashAttention-style, causal, cached prefix, optional sliding window); a token-tree verification step
     passes the tree masks to the same kernel (``attention/tree_mask.py``): a tree's new tokens see their ancestors
     only, the other sequences of the batch stay causal. A step of a few fresh prompts (no cached context) attends
     over the step's own k and v through PyTorch's fused attention instead (``attention/dense_prefill.py``).
  3. ``rotary_write_attend``: at a decode-only step over a float cache whose batch shape gets the dot-free decode
     plan (MHA, small batches: where it was measured faster, ``fuses_new_token``), one kernel does both (decode
     attention rotates q and the new k itself, attends to the new k and v from registers and writes them into the
     cache: ``NewTokenKV``), bit-equal to the two calls; ``ROOFLM_DECODE_FUSED_ROPE=0`` keeps the two kernels.
     On a Hopper GPU, at one sequence, that kernel is launched with programmatic dependent launch
     (``programmatic_launch``; ``ROOFLM_DECODE_PDL=0`` turns it off): it is scheduled while the qkv projection before
     it drains (at 4 sequences it measured no faster, so larger batches launch as before).
GQA is handled inside the kernels; K/V are never repeated. A quantized cache (``QuantizedKVCache``) is quantized by
the write kernel and dequantized in registers by both attention kernels.
"""
from __future__ import annotations

import os

import torch

from rooflm.attention.backend import AttentionMetadata, rotary_write_then_attend
from rooflm.attention.dense_prefill import attend as dense_prefill
from rooflm.attention.dense_prefill import usable as dense_prefill_usable
from rooflm.attention.kv_quant import KVCache, QuantizedKVCache
from rooflm.attention.tree_mask import packed_tree_masks
from rooflm.kernels._tl import decode_pdl_enabled
from rooflm.kernels._utils import device_sms
from rooflm.kernels.decode_attention import NewTokenKV, paged_decode_attention
from rooflm.kernels.decode_plan import fuses_new_token
from rooflm.kernels.kv_cache import rotary_write_kv_cache
from rooflm.kernels.prefill_attention import paged_prefill_attention


class TritonAttention:
    """The Triton backend (see ``AttentionBackend``): device tensors only, so decode steps can be captured."""

    name = "triton"

    def __init__(self) -> None:
        self.fuse_decode_rotary = os.environ.get("ROOFLM_DECODE_FUSED_ROPE", "1") != "0"
        self.programmatic_launch = decode_pdl_enabled()

    def rotary_and_write(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """One kernel: rotates q and k in place (and returns them) and writes k, v into the cache."""
        return rotary_write_kv_cache(q, k, v, None, cos, sin, kv_cache, meta.slot_mapping, is_neox=True)

    def rotary_write_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float,
                            sliding_window: int | None = None) -> torch.Tensor:
        if (self.fuse_decode_rotary and meta.is_decode_only and meta.num_tokens == meta.num_seqs
                and not isinstance(kv_cache, QuantizedKVCache)
                and fuses_new_token(q.shape[0], k.shape[1], q.shape[1] // k.shape[1], device_sms(q))):
            return paged_decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, scale, sliding_window,
                                          out=torch.empty_like(q), pdl=self.programmatic_launch and q.shape[0] == 1,
                                          new_kv=NewTokenKV(k, v, cos, sin, meta.slot_mapping))
        return rotary_write_then_attend(self, q, k, v, cos, sin, kv_cache, meta, scale, sliding_window)

    def attend(
        self,
        q: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if meta.is_decode_only and meta.num_tokens == meta.num_seqs:  # a one-token tree sees itself: causal
            return paged_decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, scale, sliding_window,
                                          out=torch.empty_like(q))
        if k is not None and v is not None and dense_prefill_usable(q, kv_cache, meta, sliding_window):
            return dense_prefill(q, k, v, meta, scale)
        out = torch.empty_like(q)
        return paged_prefill_attention(q, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                       meta.max_query_len, scale, sliding_window, out=out,
                                       tree=packed_tree_masks(meta))
