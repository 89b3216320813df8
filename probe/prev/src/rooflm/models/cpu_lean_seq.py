"""The lean loop's attention for one sequence with several new tokens: a speculative verify step (k drafted tokens
plus the newest one, Leviathan et al. 2023), a token-tree verify step (Cai et al. 2024, Medusa) or a chunk of a
prefill.

The CPU backend's general path gathers each sequence's whole context into a new tensor at every layer and builds
the causal mask at every layer. For a single sequence both are per-step facts: its KV blocks are usually
consecutive (the block pool hands out fresh blocks in order), so the context is one slice of each layer's cache and
is read in place, and the mask (causal within the new tokens, every cached position visible; or the token tree's
mask) is built once for all layers. The rotary embedding, the cache write and the ``scaled_dot_product_attention``
call are the backend's, on tensors of the same values, shapes and strides, so the result is the same, bit for bit
(checked in ``tests/models/test_cpu_lean_seq.py``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rooflm.attention.backend import AttentionMetadata
from rooflm.attention.cpu_backend import (
    EXACT_MAX_QUERY,
    CpuAttention,
    _gather,
    attend_as_decode,
    decode_key_counts,
    decode_key_rows,
    heads_first,
    native_paged_attend,
)


def consecutive(blocks: torch.Tensor) -> bool:
    """True when the block indices are consecutive: the context is then one slice of the cache."""
    n = blocks.shape[0]
    return n == 1 if n <= 1 else bool((blocks.diff() == 1).all())


def causal_mask(q_len: int, seq_len: int, tree: torch.Tensor | None) -> torch.Tensor | None:
    """[q_len, seq_len] bool, True where new token i (at position seq_len - q_len + i) may attend: every cached
    position, and among the new tokens those up to itself, or where the token tree's [q_len, q_len] mask allows.
    None for a causal step with no cached prefix (``is_causal`` then says the same, as the backend uses it)."""
    if tree is not None:
        return torch.cat([torch.ones(q_len, seq_len - q_len, dtype=torch.bool), tree.to("cpu")], dim=1)
    if q_len == seq_len:
        return None
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    return torch.arange(seq_len)[None, :] <= q_pos


class SeqStep:
    """What every layer of a step with one sequence of several new tokens shares: the rotary tables, the slots its
    new K/V go to, its block indices, the mask and, when the blocks are consecutive, where its K and V start in a
    layer's cache (every layer's cache has the same shape, so the same offsets)."""

    def __init__(self, backend: CpuAttention, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        self.cos2, self.sin2 = backend._rope_tables(cos, sin)
        self.backend, self.meta = backend, meta
        self.slots = meta.slot_mapping
        _, _, bs, hkv, d = kv_cache.shape
        self.seq_len = seq_len = meta.seq_lens_cpu[0]
        self.blocks = meta.block_tables[0, : (seq_len + bs - 1) // bs].long()
        tree = meta.tree_masks[0] if meta.tree_masks is not None else None
        # a short causal step after a cached prefix (a verify step) attends token by token as decode steps do
        self.as_decode = meta.num_tokens < seq_len and meta.num_tokens <= EXACT_MAX_QUERY
        # the mask of the one masked call over every token (longer steps); token by token needs none
        self.mask = None if self.as_decode else causal_mask(meta.num_tokens, seq_len, tree)
        self.rows = decode_key_rows(meta.num_tokens, seq_len, tree) if self.as_decode else None
        # the native operator's form of the rows, made once for every layer
        self.key_counts = decode_key_counts(meta.num_tokens, seq_len, self.rows) if self.as_decode else None
        self.view = None  # (size, stride, K offset, V offset) of the context as [L, Hkv, D] views
        if consecutive(self.blocks):
            start = int(self.blocks[0]) * bs * hkv * d
            self.view = ((seq_len, hkv, d), (hkv * d, d, 1), start, start + kv_cache.stride(0))


def seq_step_applies(meta: AttentionMetadata, backend: CpuAttention, dtype: torch.dtype) -> bool:
    """Whether a step can attend through ``attend_seq``: one sequence, more than one new token, every slot valid,
    a float32 cache (the caller checks that the cache is a plain contiguous tensor of the hidden state's dtype)."""
    return (meta.num_seqs == 1 and not meta.is_decode_only and backend._slots_valid and dtype == torch.float32
            and meta.num_tokens > 1)


def rotate_and_write(step, qkv: torch.Tensor, hq: int, hkv: int, d: int, kv_cache: torch.Tensor,
                     meta: AttentionMetadata) -> torch.Tensor:
    """Rotary embedding of the step's q and k heads and the write of K and V to the cache: the backend's native
    operator where it applies (a bfloat16 int4 product widened first, exactly, as the module path's cast does), else
    the backend's torch maths in fewer ops. ``step``: a ``_DecodeOne`` or ``SeqStep`` (rotary tables and slots).
    Returns the rotated heads [T, Hq + Hkv, D] (float32)."""
    t = qkv.shape[0]
    backend: CpuAttention = step.backend
    heads = qkv.view(t, hq + 2 * hkv, d)
    if backend.uses_native:
        h32 = heads if heads.dtype == torch.float32 else heads.float()
        rotated = backend.native_rope_write(h32[:, : hq + hkv], h32[:, hq + hkv:], step.cos2, step.sin2, kv_cache,
                                            meta)
        if rotated is not None:
            return rotated
    qk, v = heads[:, : hq + hkv], heads[:, hq + hkv:]
    qk = torch.addcmul(qk * step.cos2, qk.roll(d // 2, dims=-1), step.sin2)  # float32
    flat = kv_cache.view(2, kv_cache.shape[1] * kv_cache.shape[2], hkv, d)
    flat.index_copy_(1, step.slots, torch.stack((qk[:, hq:], v)))  # stack promotes a bfloat16 v exactly
    return qk


def attend_seq(step: SeqStep, attn, qkv: torch.Tensor, hq: int, hkv: int, kv_cache: torch.Tensor) -> torch.Tensor:
    """Rotary, cache write and attention of the step's new tokens, with full attention (no sliding window).
    ``qkv`` [T, q | k | v] may be the bfloat16 product of a packed int4 projection: the rotary products and the
    stack of K with V widen it to float32 exactly, as the module path's explicit cast does. Returns [T, Hq, D]."""
    d = attn.head_dim
    qk = rotate_and_write(step, qkv, hq, hkv, d, kv_cache, step.meta)
    if step.view is None and step.as_decode:
        # the native operator reads the paged context in place (the floats of the gathered copy, without the copy)
        out = native_paged_attend(qk[:, :hq], kv_cache, attn.scale, *step.key_counts, step.blocks)
        if out is not None:
            return out
    if step.view is None:
        kv = _gather(kv_cache, step.blocks, qk.dtype).flatten(1, 2)[:, : step.seq_len]  # [2, L, Hkv, D]
        k, v = kv[0], kv[1]
    else:
        size, stride, k_off, v_off = step.view
        base = kv_cache.storage_offset()  # a cache may be a view into a larger buffer
        k = kv_cache.as_strided(size, stride, base + k_off)
        v = kv_cache.as_strided(size, stride, base + v_off)
    if step.as_decode:
        return attend_as_decode(qk[:, :hq], k, v, attn.scale, step.rows)
    # heads first, as the backend's prefill attention lays them out (4-D, torch's fused kernel, for long chunks only:
    # see EXACT_MAX_QUERY); grouped-query attention (Ainslie et al. 2023) through enable_gqa: query head h uses KV
    # head h // (hq / hkv)
    q_len = qk.shape[0]
    out = F.scaled_dot_product_attention(heads_first(qk[:, :hq], q_len), heads_first(k, q_len),
                                         heads_first(v, q_len), attn_mask=step.mask, is_causal=step.mask is None,
                                         scale=attn.scale, enable_gqa=hq != hkv)
    return (out[0] if out.dim() == 4 else out).transpose(0, 1)
