"""Prefill attention of fresh prompts through PyTorch's ``scaled_dot_product_attention``.

When every sequence of a step is a fresh prompt (its context is only the step's own new tokens: no prefix-cache hit,
no earlier chunk), the keys and values the step attends to are exactly the k and v its projection just produced,
contiguous per sequence in token order, so the paged cache need not be read back: causal attention over them is
what ``torch.nn.functional.scaled_dot_product_attention(..., is_causal=True)`` computes, one call per sequence.
PyTorch then runs the fastest fused kernel it has for the device: on an H100 with the CUDA 13 build of torch 2.11
that is cuDNN's fused attention (a FlashAttention-style kernel written for Hopper's tensor cores).

Why: measured at 2048 tokens, 32 heads of 128, causal, float16 on an H100 (``python -m rooflm.kernels.bench
--sections prefill_attn``): the paged Triton kernel (``rooflm/kernels/prefill_attention.py``), which gathers every
K/V row through the block table, ran 208-255 us per layer (135-165 TFLOP/s); this path about 135 us (254-257
TFLOP/s), with 32 or 8 KV heads; PyTorch's FlashAttention-2 backend, forced, about 200 us. A 7B model's 2048-token
prefill makes 32 such calls.

Everything else keeps the Triton kernel: prefix-cache hits and later chunks (their context is in the cache only),
token trees, sliding windows (``scaled_dot_product_attention`` has no window without a dense mask), quantized caches
(the step must see the dequantized K/V it wrote, as a chunked prefill would), steps of more than ``MAX_SEQS``
sequences (one call each) and steps below ``MIN_TOKENS`` tokens. The result differs from the Triton kernel's in the
last bits (another order of the same sums), as any two attention kernels do; which of the two a step uses depends
only on the step's shape, the same in every run.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rooflm.attention.backend import AttentionMetadata
from rooflm.attention.kv_quant import KVCache, QuantizedKVCache

MIN_TOKENS = 64  # below this one fused call saves less than its launch costs
MAX_SEQS = 4  # one call per sequence: a batch of many short prompts stays with the one-launch paged kernel
_fast: dict[tuple, bool] = {}


def usable(q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, sliding_window: int | None) -> bool:
    """True when this step's attention may run through ``attend``: a CUDA float16 / bfloat16 step of at most
    ``MAX_SEQS`` fresh prompts (every sequence's length equals its query length) and at least ``MIN_TOKENS`` tokens,
    no token tree, no sliding window, an unquantized cache, and a fused kernel of PyTorch that takes the shape."""
    if (not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16) or isinstance(kv_cache, QuantizedKVCache)
            or meta.tree_masks is not None or sliding_window is not None or meta.num_seqs > MAX_SEQS
            or meta.num_tokens < MIN_TOKENS or q.shape[0] != meta.num_tokens):
        return False
    starts = meta.query_start_loc_cpu
    if any(n != starts[i + 1] - starts[i] for i, n in enumerate(meta.seq_lens_cpu)):
        return False  # some sequence has context in the cache from an earlier step
    key = (q.device, q.dtype, q.shape[1], kv_cache.shape[3], q.shape[2])
    ok = _fast.get(key)
    if ok is None:
        ok = _fast[key] = _probe(q.device, q.dtype, q.shape[1], kv_cache.shape[3], q.shape[2])
    return ok


def _probe(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether a fused kernel (cuDNN's or FlashAttention's) runs this head layout here: one tiny call with only
    those two allowed, once per layout. Without one, PyTorch would fall back to kernels that materialise the
    [T, T] scores, slower than the paged kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    x = torch.zeros(1, heads, 16, head_dim, dtype=dtype, device=device)
    kv = torch.zeros(1, kv_heads, 16, head_dim, dtype=dtype, device=device)
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            F.scaled_dot_product_attention(x, kv, kv, is_causal=True, enable_gqa=heads != kv_heads)
        return True
    except RuntimeError:
        return False


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
           scale: float) -> torch.Tensor:
    """Causal attention of each fresh sequence over its own new tokens (``usable`` said yes). q [T, H, D] rotated,
    k and v [T, H_kv, D] (k rotated: the values written to the cache) -> [T, H, D]."""
    starts = meta.query_start_loc_cpu
    gqa = q.shape[1] != k.shape[1]

    def one(s: int, e: int) -> torch.Tensor:  # [L, H, D] <-> [1, H, L, D]: strided views, no copies
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1)[None], k[s:e].transpose(0, 1)[None],
                                           v[s:e].transpose(0, 1)[None], is_causal=True, scale=scale, enable_gqa=gqa)
        return o[0].transpose(0, 1)

    if meta.num_seqs == 1:
        return one(0, starts[1]).contiguous()  # no copy where the kernel wrote [L, H, D] order (q's own layout)
    out = torch.empty_like(q)
    for i in range(meta.num_seqs):
        s, e = starts[i], starts[i + 1]
        if e > s:
            out[s:e] = one(s, e)
    return out
