"""Asymmetric integer-zero-point quantization of weight groups, the grid GPTQ and AWQ checkpoints store:
``w ~ s * (q - z)`` with unsigned q in [0, 2^bits) and an integer z (Frantar et al. 2023; Lin et al. 2024).

Scales are rounded to float16 when they are computed, so the codes are chosen against the scale the checkpoint will
hold. ``min_zero = 1`` keeps every zero point >= 1, which GPTQ's classic checkpoint format needs (it stores z - 1):
a group with no negative weight then gets z = 1 and the scale ``max / (2^bits - 2)``, which still covers its range.
"""
from __future__ import annotations

import torch

from rooflm.quantization.formats import IntQuant


def group_params(w: torch.Tensor, bits: int, min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, integer zero points) float32 [...] for the groups in the last dim of float w [..., g]."""
    qmax = 2 ** bits - 1
    w = w.float()
    lo = w.amin(-1).clamp(max=0)  # the grid always holds 0, so zero weights stay exact
    hi = w.amax(-1).clamp(min=0)
    scales = ((hi - lo) / qmax).clamp_min(1e-8)
    zeros = torch.round(-lo / scales).clamp(0, qmax)
    if min_zero:
        low = zeros < min_zero
        scales = torch.where(low, (hi / (qmax - min_zero)).clamp_min(1e-8), scales)
        zeros = torch.where(low, torch.full_like(zeros, float(min_zero)), zeros)
    scales = scales.to(torch.float16).float().clamp_min(2 ** -24)  # float16's smallest positive value
    return scales, zeros


def search_group_params(w: torch.Tensor, bits: int, min_zero: int = 0, n_scales: int = 31,
                        span: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    """Like ``group_params``, but each group's (scale, integer zero point) is the pair, among ``n_scales`` scales
    from (1 - span/2) to (1 + span/2) times the min/max scale and, for each, the zero points next to the min/max one
    (-1, 0, +1), with the smallest squared rounding error of the group's weights. The min/max grid is a candidate,
    so a group's error never grows. Why it pays: with an integer zero point the min/max grid can sit up to half a
    step off the group's values as a whole (a bias the group's inputs add up instead of averaging out); a slightly
    smaller or larger step and a neighbouring zero point often fit better. GPTQ's reference implementation has the
    same option (a grid search over shrunk ranges, Frantar et al. 2023); llama.cpp's k-quants search scale and
    minimum per block likewise."""
    if n_scales < 1:
        raise ValueError(f"n_scales={n_scales} must be at least 1")
    qmax = 2 ** bits - 1
    w = w.float()
    lo = w.amin(-1).clamp(max=0)
    rng = (w.amax(-1).clamp(min=0) - lo).clamp_min(1e-8)
    best_s, best_z = group_params(w, bits, min_zero)
    best_e = _squared_error(w, best_s, best_z, bits)
    for i in range(n_scales):
        f = 1.0 + span * (i / (n_scales - 1) - 0.5) if n_scales > 1 else 1.0
        s = (rng * f / qmax).to(torch.float16).float().clamp_min(2 ** -24)
        z0 = torch.round(-lo / s)
        for dz in (-1, 0, 1):
            z = (z0 + dz).clamp(min_zero, qmax)
            e = _squared_error(w, s, z, bits)
            better = e < best_e
            best_e = torch.where(better, e, best_e)
            best_s = torch.where(better, s, best_s)
            best_z = torch.where(better, z, best_z)
    return best_s, best_z


def _squared_error(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor, bits: int) -> torch.Tensor:
    q = quantize_codes(w, s, z, bits)
    return ((q - z.unsqueeze(-1)) * s.unsqueeze(-1) - w).square().sum(-1)


def quantize_codes(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of w [..., g] on the grid of per-group scales / zeros [...] (broadcast over the last dim)."""
    return (torch.round(w.float() / scales.unsqueeze(-1)) + zeros.unsqueeze(-1)).clamp(0, 2 ** bits - 1)


def fake_quantize(w: torch.Tensor, bits: int, group_size: int, min_zero: int = 0) -> torch.Tensor:
    """w [N, K] quantized and dequantized group-wise (float32): the weight a quantized layer multiplies with."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    s, z = group_params(g, bits, min_zero)
    q = quantize_codes(g, s, z, bits)
    return ((q - z.unsqueeze(-1)) * s.unsqueeze(-1)).reshape(n, k)


def quantize_int(w: torch.Tensor, bits: int, group_size: int, min_zero: int = 0, search: bool = False) -> IntQuant:
    """Round-to-nearest with integer zero points: float w [N, K] -> ``IntQuant``; ``search``: each group's grid from
    ``search_group_params`` instead of its min and max."""
    if bits not in (4, 8):
        raise ValueError(f"bits={bits} is not supported: expected 4 or 8")
    n, k = w.shape
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size={group_size} does not divide in_features={k}")
    g = w.float().reshape(n, k // group_size, group_size)
    s, z = (search_group_params if search else group_params)(g, bits, min_zero)
    q = quantize_codes(g, s, z, bits).reshape(n, k)
    return IntQuant(codes=q.to(torch.int16), scales=s, zeros=z.to(torch.int16), bits=bits, group_size=group_size)
