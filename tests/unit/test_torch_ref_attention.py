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


def _rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """RoPE in float64 as a complex product: pair (x[i], x[i + half]) times e^(i * angle)."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double()) * torch.polar(
        torch.ones_like(angles), angles)[:, None, :]
    return torch.cat((z.real, z.imag), dim=-1)


def _dense_attention(q, k, v, scale, window):
    """q [Lq, H, D] are the last Lq of the Lk positions; k, v [Lk, Hkv, D]; float64 causal softmax attention."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    qpos = torch.arange(k.shape[0] - q.shape[0], k.shape[0])[:, None]
    kpos = torch.arange(k.shape[0])[None, :]
    allowed = (kpos <= qpos) & ((kpos > qpos - window) if window is not None else True)
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1), v)


@pytest.mark.parametrize("ctx_lens, q_lens, window", [
    ([0, 5, 9], [6, 1, 3], None),  # prefill, decode and extend in one step
    ([3, 8, 11, 0], [1, 1, 1, 1], None),  # decode only: the batched path
    ([2, 13], [7, 1], 4),  # sliding window
])
def test_rotary_and_write_then_attend_equals_dense_attention(ctx_lens, q_lens, window):
    """The reference backend's two protocol calls against an independent oracle on fresh random inputs: RoPE as a
    complex rotation, the cache written at exactly the given slots (the rest untouched), and dense causal attention
    over each sequence's contiguous history."""
    from rooflm.attention.metadata_utils import build_attention_metadata
    from rooflm.attention.torch_ref import TorchRefAttention

    g = torch.Generator().manual_seed(sum(ctx_lens) + len(q_lens))
    H, Hkv, D, bs, num_blocks = 6, 2, 8, 4, 24
    cache = torch.randn(2, num_blocks, bs, Hkv, D, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for c, n in zip(ctx_lens, q_lens):
        nb = -(-(c + n) // bs)
        tables.append(perm[used:used + nb])
        used += nb
    meta, _ = build_attention_metadata(tables, ctx_lens, q_lens, bs)
    T = sum(q_lens)
    qkv = torch.randn(T, H + 2 * Hkv, D, generator=g)
    q, k, v = qkv.split([H, Hkv, Hkv], dim=1)
    angles = 50 * torch.rand(T, D // 2, generator=g, dtype=torch.float64)
    before = cache.clone()

    backend = TorchRefAttention()
    rq, rk = backend.rotary_and_write(q, k, v, angles.cos().float(), angles.sin().float(), cache, meta)
    out = backend.attend(rq, cache, meta, 0.37, window)

    want_q, want_k = _rotate(q, angles), _rotate(k, angles)
    torch.testing.assert_close(rq.double(), want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rk.double(), want_k, rtol=1e-5, atol=1e-5)
    slots = meta.slot_mapping
    flat, flat_before = cache.view(2, -1, Hkv, D), before.view(2, -1, Hkv, D)
    torch.testing.assert_close(flat[0, slots].double(), want_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(flat[1, slots], v)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[:, untouched], flat_before[:, untouched])

    start = 0
    for i, (c, n) in enumerate(zip(ctx_lens, q_lens)):
        hist = [tables[i][p // bs] * bs + p % bs for p in range(c)]
        keys = torch.cat((flat_before[0, hist].double(), want_k[start:start + n]))
        vals = torch.cat((flat_before[1, hist].double(), v[start:start + n].double()))
        want = _dense_attention(want_q[start:start + n], keys, vals, 0.37, window)
        torch.testing.assert_close(out[start:start + n].double(), want, rtol=1e-4, atol=1e-5)
        start += n
