"""The reference attention's batched decode path equals its per-sequence path (the obviously correct one)."""
from __future__ import annotations

import pytest
import torch

from rooflm.attention.torch_ref import attend, attend_decode_batched, gather_context


@pytest.mark.parametrize("num_heads, num_kv_heads, window", [(4, 4, None), (8, 2, None), (6, 1, None), (8, 2, 5)])
def test_batched_decode_equals_per_sequence(num_heads, num_kv_heads, window):
    torch.manual_seed(0)
    block_size, head_dim, num_blocks = 4, 8, 40
    seq_lens = [1, 3, 4, 5, 17, 9]
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim)
    perm = torch.randperm(num_blocks).tolist()
    max_blocks = max((n + block_size - 1) // block_size for n in seq_lens)
    tables, used = [], 0
    for n in seq_lens:  # scattered, non-contiguous blocks, padded with 0
        nb = (n + block_size - 1) // block_size
        tables.append(perm[used:used + nb] + [0] * (max_blocks - nb))
        used += nb
    tables_t = torch.tensor(tables, dtype=torch.int32)
    q = torch.randn(len(seq_lens), num_heads, head_dim)
    got = attend_decode_batched(q, cache, tables_t, torch.tensor(seq_lens), 0.3, window)
    for i, n in enumerate(seq_lens):
        k, v = gather_context(cache, tables_t[i], n)
        want = attend(q[i:i + 1], k, v, 0.3, window)
        torch.testing.assert_close(got[i:i + 1], want, rtol=1e-5, atol=1e-5)
