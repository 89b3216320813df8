"""The attention layer seen by a model: reshape to heads, call the attention backend over the paged KV cache."""
from __future__ import annotations

import torch
from torch import nn

from rooflm.attention.backend import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    """Stateless apart from its shape: the cache tensor and the metadata come with every call."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        backend: AttentionBackend,
        scale: float | None = None,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.backend = backend

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim] (rotated)
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] (rotated)
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        kv_written: bool = False,  # the caller already wrote k/v into the cache (backend.rotary_and_write, GPU)
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        if kv_written:
            out = self.backend.forward(q, k, v, kv_cache, meta, self.scale, self.sliding_window, kv_written=True)
        else:
            out = self.backend.forward(q, k, v, kv_cache, meta, self.scale, self.sliding_window)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"sliding_window={self.sliding_window}, backend={getattr(self.backend, 'name', '?')}")
