"""The attention layer seen by a model: rotary embedding, KV-cache write and attention over the paged cache, all
through the attention backend this layer chose when it was built (see ``AttentionBackend``)."""
from __future__ import annotations

import torch

from rooflm.attention.backend import AttentionBackend, AttentionMetadata, get_attention_backend
from rooflm.layers.custom_op import CPU, NATIVE, TRITON, CustomOp, OpSelection


class Attention(CustomOp):
    """Stateless apart from its shape and its backend: the cache tensor and the metadata come with every call.

    The backend ("torch", the reference, "triton" or "cpu") follows the op selection's ``attention`` setting;
    ``impl`` is "native" for the torch backend, "cpu" for the CPU one and "triton" for the Triton one. ``backend`` is
    kept as an attribute: the engine reads its ``name`` to decide whether decode steps can be captured in a CUDA
    graph."""

    backend: AttentionBackend

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float | None = None,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window

    def choose(self, selection: OpSelection) -> None:
        name = selection.attention_impl()
        # one backend for every layer of a model (backends keep at most per-step tables, shared by all layers)
        key = ("attention_backend", name)
        if key not in selection.shared:
            selection.shared[key] = get_attention_backend(name)
        self.backend = selection.shared[key]
        self._set_impl({"torch": NATIVE, "cpu": CPU}.get(name, TRITON))

    def forward_native(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        cos: torch.Tensor,  # [num_tokens, head_dim // 2]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        if meta.attn_scores is None:
            out = self.backend.rotary_write_attend(q, k, v, cos, sin, kv_cache, meta, self.scale, self.sliding_window)
        else:  # H2O: the probabilities the fused attention does not give, from the rotated queries
            q, k = self.backend.rotary_and_write(q, k, v, cos, sin, kv_cache, meta)
            out = self.backend.attend(q, kv_cache, meta, self.scale, self.sliding_window, k, v)
            meta.attn_scores.add(q, kv_cache, self.scale)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    # The two paths differ only in the backend chosen above.
    forward_cuda = forward_native

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"sliding_window={self.sliding_window}, backend={self.backend.name}")
