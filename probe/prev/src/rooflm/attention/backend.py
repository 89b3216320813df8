"""The attention-backend interface and the metadata every backend reads.

A step's tokens come as one flat batch with no padding. Sequence ``i`` contributes the new tokens
``q[query_start_loc[i] : query_start_loc[i + 1]]``; they are the *last* ``query_len_i`` tokens of its
``seq_lens[i]`` tokens of context, so token ``j`` of them sits at position ``seq_lens[i] - query_len_i + j``.
Before attending, a backend writes each new token's K/V into the paged cache at ``slot_mapping``
(``slot = block_id * block_size + offset``; a slot of -1 is not written). Sequence ``i``'s context lives in the blocks
``block_tables[i, : ceil(seq_lens[i] / block_size)]``.

KV cache of one layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 keys, 1 values), or with
``kv_cache_dtype`` "int8" / "fp8" a ``QuantizedKVCache`` (``attention/kv_quant.py``): values of that shape plus one
float32 scale per (K or V, slot, KV head). Every backend accepts both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from rooflm.attention.kv_quant import KVCache, QuantizedKVCache, write_quantized
from rooflm.attention.tree_mask import PackedTreeMasks


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, on the device
    seq_lens: torch.Tensor  # [num_seqs] int32, on the device
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host copies (the reference path and the runner's bookkeeping read these without a device sync).
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # Token-tree verification (spec_decode/tree.py): per sequence None (causal) or a [Q, Q] bool mask over its Q new
    # tokens (True: may attend); the cached context before them is visible to all. None: every sequence causal.
    tree_masks: list[torch.Tensor | None] | None = None
    # The same masks packed for the Triton kernel (attention/tree_mask.py): built from tree_masks by the first layer
    # that needs them and reused by the others (so tree_masks must not change after the first attend).
    tree_masks_packed: PackedTreeMasks | None = None
    # H2O KV compression: a rooflm.attention.h2o_scores.BlockScoreCollector that every attention layer feeds with
    # its queries after attending, for the requests whose attention scores the scheduler asked for; None: off.
    attn_scores: "object | None" = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(Protocol):
    """Everything a model calls on its attention backend, once per layer and step: either ``rotary_write_attend``
    alone, or, where the caller needs the rotated queries afterwards (H2O's scores), these two in this order:

    1. ``rotary_and_write``: rotate the new queries and keys by their positions (RoPE, Su et al. 2021, Hugging Face's
       "rotate_half" layout) and write the rotated keys and the values into the paged cache at ``meta.slot_mapping``;
    2. ``attend``: attend each sequence's queries to its cached context, the new tokens included (causal, optionally
       a sliding window of the last ``sliding_window`` positions, the query's own included).

    ``name`` ("torch", "triton" or "cpu") tells the engine whether a step can be captured in a CUDA graph.
    ``programmatic_launch``: whether ``rotary_write_attend`` may launch its kernel with programmatic dependent launch
    (Hopper GPUs), so the kernel before it (the qkv projection) may let it be scheduled early and the kernel after it
    (o_proj) may be launched so and wait in place; such a kernel reads nothing the kernel before writes until it has
    waited for it."""

    name: str
    programmatic_launch: bool

    def rotary_and_write(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        cos: torch.Tensor,  # [num_tokens, head_dim // 2]: row t is token t's angles (q's dtype)
        sin: torch.Tensor,  # [num_tokens, head_dim // 2]
        kv_cache: KVCache,  # [2, num_blocks, block_size, num_kv_heads, head_dim] (+ scales when quantized)
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # rotated (q, k); a backend may rotate the inputs in place and return them
        ...

    def attend(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated
        kv_cache: KVCache,  # holds every context token of the step's sequences, the new ones included
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        k: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim]: the step's rotated keys, as written
        v: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim]: the step's values, as written
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """``k`` and ``v`` (optional) are the new tokens' keys and values that ``rotary_and_write`` just wrote: a
        backend may attend to them directly where the cache holds nothing else for the step's sequences (fresh
        prompts), instead of reading them back from the cache."""
        ...

    def rotary_write_attend(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], not rotated
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], not rotated
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        cos: torch.Tensor,  # [num_tokens, head_dim // 2]
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """``rotary_and_write`` then ``attend`` (``rotary_write_then_attend``), or one kernel doing both: the same
        output and cache. Where fused, q and k may be left unrotated."""
        ...


def rotary_write_then_attend(backend: AttentionBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                             scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """``rotary_write_attend`` as the backend's two calls (what a backend without a fused path uses)."""
    q, k = backend.rotary_and_write(q, k, v, cos, sin, kv_cache, meta)
    return backend.attend(q, kv_cache, meta, scale, sliding_window, k, v)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor,
                   all_valid: bool | None = None) -> None:
    """Scatter new keys/values into the paged cache (quantizing them for a ``QuantizedKVCache``).
    k, v: [num_tokens, num_kv_heads, head_dim]. Slots < 0 (padding) are skipped; ``all_valid``: the caller already
    knows whether any is (it reads the slots back from the device otherwise)."""
    if isinstance(kv_cache, QuantizedKVCache):
        write_quantized(k, v, kv_cache, slot_mapping)
        return
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    if all_valid is None:
        all_valid = bool((slot_mapping >= 0).all())
    if all_valid:  # keys and values in one scatter
        flat.index_copy_(1, slot_mapping, torch.stack((k, v)).to(kv_cache.dtype))
    else:
        valid = slot_mapping >= 0
        idx = slot_mapping[valid]
        flat[0].index_copy_(0, idx, k[valid].to(kv_cache.dtype))
        flat[1].index_copy_(0, idx, v[valid].to(kv_cache.dtype))


def get_attention_backend(name: str = "torch", device: torch.device | str = "cpu") -> AttentionBackend:
    """``torch``: the reference (any device); ``triton``: the GPU kernels; ``cpu``: few large torch ops, for the CPU;
    ``auto``: triton on CUDA when importable, cpu on the CPU, torch otherwise."""
    if name == "auto":
        dev = torch.device(device).type
        name = "triton" if dev == "cuda" and _triton_available() else "cpu" if dev == "cpu" else "torch"
    if name == "torch":
        from rooflm.attention.torch_ref import TorchRefAttention

        return TorchRefAttention()
    if name == "triton":
        from rooflm.attention.triton_backend import TritonAttention

        return TritonAttention()
    if name == "cpu":
        from rooflm.attention.cpu_backend import CpuAttention

        return CpuAttention()
    raise ValueError(f"attention_backend={name!r} is unknown: expected 'torch', 'triton', 'cpu' or 'auto'")


def _triton_available() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("triton") is not None and importlib.util.find_spec(
            "rooflm.attention.triton_backend") is not None
    except Exception:
        return False
