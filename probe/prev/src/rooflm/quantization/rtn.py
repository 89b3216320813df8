"""Round-to-nearest (RTN) weight quantization: the baseline that GPTQ (Frantar et al. 2023) and AWQ (Lin et al.
2024) improve on, and what ``quantization="w8a16"`` / ``"w4a16"`` apply at load time.

- 8 bits: symmetric, one scale per output channel (``group_size = K``): ``s = max|w| / 127``, ``q = round(w / s)``.
- 4 bits: asymmetric with an integer zero point per group of ``group_size`` input columns (128 by default), the
  convention of GPTQ and AWQ checkpoints: ``s = (max - min) / 15``, ``z = round(-min / s)``,
  ``q = clamp(round(w / s) + z, 0, 15)``, so ``w ~ s * (q - z)``; stored as scale and min ``-s * z``
  (``rooflm.quantization.packed``). Keeping z an integer is what lets a checkpoint made here be written in the GPTQ
  and AWQ formats without another rounding.
"""
from __future__ import annotations

import torch

from rooflm.quantization.packed import PackedWeight, pack_int4


def quantize_scales_zeros(w: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-group (scales, integer zero points) of float w [N, K], both [N, K // group_size] float32; zeros None for
    8 bits (symmetric)."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    if bits == 8:
        return (g.abs().amax(-1) / 127).clamp_min(1e-10), None
    qmax = 2 ** bits - 1
    lo = g.amin(-1).clamp(max=0)  # the range always holds 0, so zero weights stay exact
    hi = g.amax(-1).clamp(min=0)
    scales = ((hi - lo) / qmax).clamp_min(1e-10)
    zeros = torch.round(-lo / scales).clamp(0, qmax)
    return scales, zeros


def quantize_with(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                  group_size: int) -> torch.Tensor:
    """Integer codes of w [N, K] for given per-group scales / zero points: int8 [-127, 127] for 8 bits, uint8
    [0, 15] (unpacked) for 4 bits."""
    n, k = w.shape
    s = scales.repeat_interleave(group_size, dim=1)
    if bits == 8:
        return torch.round(w.float() / s).clamp(-127, 127).to(torch.int8)
    z = zeros.repeat_interleave(group_size, dim=1)
    return (torch.round(w.float() / s) + z).clamp(0, 2 ** bits - 1).to(torch.uint8)


def pack(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int, group_size: int,
         dtype: torch.dtype, perm: torch.Tensor | None = None) -> PackedWeight:
    """Codes + scales + integer zero points (all in stored column order) -> ``PackedWeight`` in ``dtype``."""
    mins = None if zeros is None else (-scales * zeros).to(dtype)
    qweight = pack_int4(q) if bits == 4 else q.to(torch.int8)
    return PackedWeight(qweight=qweight, scales=scales.to(dtype), mins=mins, bits=bits, group_size=group_size,
                        perm=perm)


def quantize_rtn(w: torch.Tensor, bits: int, group_size: int | None = None,
                 dtype: torch.dtype | None = None) -> PackedWeight:
    """RTN-quantize float w [N, K]. ``group_size`` None: K (per channel) for 8 bits, 128 for 4 bits (or K when K
    is smaller). The scales and mins are kept in ``dtype`` (default: w's dtype)."""
    if bits not in (4, 8):
        raise ValueError(f"bits={bits} is not supported: expected 4 or 8")
    k = w.shape[1]
    if group_size is None:
        group_size = k if bits == 8 else min(128, k)
    if k % group_size:
        raise ValueError(f"group_size={group_size} does not divide in_features={k}")
    scales, zeros = quantize_scales_zeros(w, bits, group_size)
    q = quantize_with(w, scales, zeros, bits, group_size)
    return pack(q, scales, zeros, bits, group_size, dtype or w.dtype)
