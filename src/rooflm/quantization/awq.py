"""AWQ (Lin et al. 2024, "AWQ: Activation-aware Weight Quantization for LLM Compression and Acceleration").

A small fraction of input channels carry activations much larger than the rest; the weights they multiply matter
most. AWQ scales those weight columns up by a per-input-channel factor s before round-to-nearest (W' = W diag(s),
so their relative rounding error shrinks) and divides the input by s, which costs nothing once 1/s is folded into
the operation that produces the input (an RMSNorm weight, or the rows of the projection before):

    s = mean|x|^alpha (normalised so that max(s) * min(s) = 1),    alpha on a grid of 20 points in [0, 1),

and alpha is chosen to minimise the layer-output error ``||x W^T - (x / s) Q(W diag(s))^T||^2`` on calibration
inputs. alpha = 0 is plain round-to-nearest, so the search never does worse than RTN on the calibration inputs.
The paper's second step, a per-group search of a clipping range, is not done here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rooflm.quantization.formats import IntQuant
from rooflm.quantization.zeropoint import fake_quantize, quantize_int

N_GRID = 20


@dataclass
class AWQSearch:
    scales: torch.Tensor  # [K] float32, the factor each input channel's weights are multiplied by
    alpha: float
    loss: float  # mean squared output error with the chosen scales
    rtn_loss: float  # the same without scaling (alpha = 0)


def activation_scales(x_absmean: torch.Tensor, alpha: float) -> torch.Tensor:
    """``mean|x|^alpha``, clamped away from 0 and normalised so that max * min = 1 (the scale of the whole vector
    is arbitrary; centring it keeps the folded weights in range)."""
    s = x_absmean.float().clamp_min(1e-4).pow(alpha)
    return s / (s.max() * s.min()).sqrt()


@torch.no_grad()
def search_scales(w: torch.Tensor, x: torch.Tensor, x_absmean: torch.Tensor | None, bits: int, group_size: int,
                  n_grid: int = N_GRID, min_zero: int = 0) -> AWQSearch:
    """Grid-search alpha for float w [N, K] on calibration inputs x [M, K]; ``x_absmean`` [K] is mean|x| over all
    calibration tokens (default: over x)."""
    if x.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected [M, {w.shape[1]}]")
    if n_grid < 1:
        raise ValueError(f"n_grid={n_grid} must be at least 1")
    w, x = w.float(), x.float()
    mean = x.abs().mean(0) if x_absmean is None else x_absmean.float()
    ref = x @ w.t()
    best: tuple[float, float, torch.Tensor] | None = None
    rtn_loss = float("nan")
    for i in range(n_grid):
        alpha = i / n_grid
        s = activation_scales(mean, alpha)
        wq = fake_quantize(w * s, bits, group_size, min_zero) / s
        loss = (x @ wq.t() - ref).pow(2).mean().item()
        if i == 0:
            rtn_loss = loss
        if best is None or loss < best[0]:
            best = (loss, alpha, s)
    loss, alpha, s = best
    return AWQSearch(scales=s, alpha=alpha, loss=loss, rtn_loss=rtn_loss)


def awq_quantize(w: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, min_zero: int = 0) -> IntQuant:
    """Quantize ``w diag(scales)`` (the layer whose input is divided by ``scales``)."""
    return quantize_int(w.float() * scales.float(), bits, group_size, min_zero)
