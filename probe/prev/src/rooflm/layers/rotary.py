"""Rotary position embedding (RoPE), HF "rotate_half" layout: dimension i pairs with i + head_dim / 2.

Supported ``rope_scaling`` types: none/"default", "linear", "llama3" (Llama 3.1's frequency-dependent scaling) and
"freq_factors" (per-frequency divisors as stored in GGUF files' ``rope_freqs`` tensor, llama.cpp's form of llama3).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


def base_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """[rotary_dim // 2] float32: theta ** (-2i / rotary_dim)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths are divided by ``factor``, short ones kept, the band between interpolated."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(rotary_dim: int, theta: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = base_inv_freq(rotary_dim, theta)
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        return llama3_inv_freq(inv_freq, rope_scaling)
    if rope_type == "freq_factors":
        return inv_freq / torch.tensor(rope_scaling["factors"], dtype=torch.float32)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported: expected one of {SUPPORTED_ROPE_TYPES}")


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, head_dim // 2] (x's dtype). Returns x rotated."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RotaryEmbedding(nn.Module):
    """Holds the inverse frequencies; ``cos_sin(positions)`` is computed once per forward and shared by all layers."""

    def __init__(self, head_dim: int, theta: float, rope_scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self._args = (theta, rope_scaling)
        # float32 whatever the model dtype (excluded from .to(dtype) casting by being re-made in float32 on use).
        self.register_buffer("inv_freq", compute_inv_freq(head_dim, theta, rope_scaling), persistent=False)

    def init_buffers(self) -> None:
        """Re-make ``inv_freq`` where it lives (a model built on the meta device gets its storage afterwards)."""
        with torch.device(self.inv_freq.device):
            self.inv_freq.copy_(compute_inv_freq(self.head_dim, *self._args))
        self.__dict__.pop("_host_table", None)  # made from the old inv_freq
        self.__dict__.pop("_device_table", None)

    def use_device_table(self, num_positions: int, dtype: torch.dtype) -> None:
        """From now on look cos / sin up on the GPU for positions below ``num_positions`` in ``dtype`` (the caller
        guarantees the bound: the engine passes its longest sequence). The table is made once by the very operations
        ``cos_sin`` otherwise runs per call, on the same device (the same float32 angles, the same cos and sin
        kernels, the same rounding to ``dtype``; CUDA computes each element alone, whatever the tensor's size), so a
        lookup returns the same bits in one gather kernel instead of six small ones a forward pass (a cast, the
        product, cos, sin and two casts: about 8 us of GPU time in a 3.8 ms batch-1 decode step of a 7B model on an
        H200). Nothing happens off CUDA: the CPU has its own table (``host_table``)."""
        if num_positions < 1:
            raise ValueError(f"num_positions={num_positions} must be at least 1")
        if self.inv_freq.device.type != "cuda":
            return
        with torch.no_grad():
            freqs = torch.arange(num_positions, device=self.inv_freq.device).float()[:, None] * self.inv_freq.float()
            self.__dict__["_device_table"] = torch.cat([freqs.cos().to(dtype), freqs.sin().to(dtype)], dim=1)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [num_tokens] long -> cos, sin: [num_tokens, head_dim // 2] in ``dtype`` (angles in float32).

        On the CPU they are looked up in a table (``host_table``) instead of computed: torch's vectorised float32
        cos / sin on the CPU were seen to return values off by up to 1.5e-4 for part of a call's elements, in some
        runs and not others (two threads each taking half of the tensor; the same call repeated gave the right
        values), which made greedy outputs differ from run to run. A lookup involves no arithmetic at all."""
        if positions.device.type == "cpu":
            table = self.host_table(int(positions.max()) + 1 if positions.numel() else 1)
            half = self.inv_freq.shape[0]
            rows = table.index_select(0, positions)
            return rows[:, :half].to(dtype), rows[:, half:].to(dtype)
        table = self.__dict__.get("_device_table")
        if table is not None and table.device == positions.device and table.dtype == dtype:
            half = self.inv_freq.shape[0]
            rows = table.index_select(0, positions)  # [num_tokens, 2 half]: cos and sin as views of one row stride
            return rows[:, :half], rows[:, half:]
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    def host_table(self, num_positions: int) -> torch.Tensor:
        """[P >= num_positions, head_dim] float32 on the CPU: [cos | sin] of position p's angles (p * inv_freq, the
        product rounded to float32 as the GPU path computes it), evaluated in float64 by numpy on the calling thread
        and rounded once. Grown by doubling, so a long sequence rebuilds it only a few times."""
        table = self.__dict__.get("_host_table")
        if table is None or table.shape[0] < num_positions:
            import numpy as np

            size = max(num_positions, 2 * (0 if table is None else table.shape[0]), 4096)
            angles = (torch.arange(size, dtype=torch.float32)[:, None] * self.inv_freq.float().cpu()[None, :])
            a = angles.double().numpy()
            table = torch.from_numpy(np.concatenate([np.cos(a), np.sin(a)], axis=1).astype(np.float32))
            self.__dict__["_host_table"] = table
        return table
