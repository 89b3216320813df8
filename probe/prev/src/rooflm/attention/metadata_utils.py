"""Build ``AttentionMetadata`` from plain per-sequence numbers. Used by tests and tools that drive a model directly;
the engine's model runner builds the same fields from its scheduler output."""
from __future__ import annotations

import torch

from rooflm.attention.backend import AttentionMetadata
from rooflm.attention.kv_quant import KVCache, allocate_kv_cache


def build_attention_metadata(
    block_tables: list[list[int]],  # per sequence: its block ids, covering at least num_computed + num_new slots
    num_computed: list[int],  # per sequence: tokens already in the cache
    num_new: list[int],  # per sequence: tokens computed in this step
    block_size: int,
    device: torch.device | str = "cpu",
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata for one step of a flat batch, and the positions [num_tokens] long of its tokens (sequence by sequence)."""
    slots: list[int] = []
    positions: list[int] = []
    for table, done, new in zip(block_tables, num_computed, num_new, strict=True):
        if (done + new + block_size - 1) // block_size > len(table):
            raise ValueError(f"block table of {len(table)} blocks is too short for {done + new} tokens")
        for pos in range(done, done + new):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    starts = [0]
    for new in num_new:
        starts.append(starts[-1] + new)
    seq_lens = [d + n for d, n in zip(num_computed, num_new)]
    width = max((len(t) for t in block_tables), default=0) or 1
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        max_query_len=max(num_new, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    return meta, torch.tensor(positions, dtype=torch.int64, device=device)


def single_sequence_metadata(
    num_computed: int, num_new: int, block_size: int, device: torch.device | str = "cpu"
) -> tuple[AttentionMetadata, torch.Tensor]:
    """One sequence whose blocks are 0, 1, 2, ... (a prefill when num_computed == 0, a decode step when num_new == 1)."""
    n_blocks = (num_computed + num_new + block_size - 1) // block_size
    return build_attention_metadata([list(range(n_blocks))], [num_computed], [num_new], block_size, device)


def allocate_kv_caches(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", kv_cache_dtype: str = "auto",
) -> list[KVCache]:
    """Zeroed per-layer caches [2, num_blocks, block_size, num_kv_heads, head_dim] in ``dtype``, or quantized ones
    (``QuantizedKVCache``) for ``kv_cache_dtype`` "int8" / "fp8"."""
    return [allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, kv_cache_dtype, device)
            for _ in range(num_layers)]
