"""AWQ (Lin et al. 2024, "AWQ: Activation-aware Weight Quantization for LLM Compression and Acceleration").

A small fraction of input channels carry activations much larger than the rest; the weights they multiply matter
most. AWQ scales those weight columns up by a per-input-channel factor s before round-to-nearest (W' = W diag(s),
so their relative rounding error shrinks) and divides the input by s, which costs nothing once 1/s is folded into
the operation that produces the input (an RMSNorm weight, or the rows of the projection before):

    s = mean|x|^alpha (normalised so that max(s) * min(s) = 1),    alpha on a grid of 20 points in [0, 1),

and alpha is chosen to minimise the layer-output error ``||x W^T - (x / s) Q(W diag(s))^T||^2`` on calibration
inputs. alpha = 0 is plain round-to-nearest, so the search never does worse than RTN on the calibration inputs.

The second step (``search_clip``) shrinks each group's range: weights are clamped to [-m, m] with m a fraction
(1, 0.95, ..., 0.55) of the group's max |w|, chosen per group to minimise that group's share of the output error.
Clipping a few large weights buys a finer grid for the rest.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rooflm.quantization.formats import IntQuant
from rooflm.quantization.zeropoint import fake_quantize, group_params, quantize_codes, quantize_int

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


@torch.no_grad()
def search_clip(w: torch.Tensor, x: torch.Tensor, bits: int, group_size: int, n_grid: int = 20,
                max_shrink: float = 0.5, min_zero: int = 0, rows_per_chunk: int = 1024) -> torch.Tensor:
    """Per-group clipping bounds [N, K // group_size] for float w [N, K] (already scaled) on inputs x [M, K] (already
    divided by the scales): for each group the bound among ``max|w| * (1 - i / n_grid)``, i < n_grid * max_shrink,
    that minimises ``mean_m (x_g . (Q(clamp(w_g)) - w_g))^2``. i = 0 (no clipping) is a candidate."""
    n, k = w.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected [M, {k}]")
    groups = k // group_size
    xg = x.float().reshape(-1, groups, group_size)
    # mean_m (x_g . d)^2 = d^T C_g d with C_g the group's input second moment: the cost no longer grows with M
    cov = torch.einsum("mgk,mgl->gkl", xg, xg) / max(1, xg.shape[0])
    out = torch.empty(n, groups)
    for r0 in range(0, n, rows_per_chunk):
        wg = w[r0:r0 + rows_per_chunk].float().reshape(-1, groups, group_size)
        org = wg.abs().amax(-1)
        best_err = torch.full_like(org, float("inf"))
        best = org.clone()
        for i in range(max(1, int(n_grid * max_shrink))):
            bound = org * (1 - i / n_grid)
            cur = torch.maximum(torch.minimum(wg, bound.unsqueeze(-1)), -bound.unsqueeze(-1))
            s, z = group_params(cur, bits, min_zero)
            d = (quantize_codes(cur, s, z, bits) - z.unsqueeze(-1)) * s.unsqueeze(-1) - wg
            err = (torch.einsum("ngk,gkl->ngl", d, cov) * d).sum(-1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better, bound, best)
        out[r0:r0 + rows_per_chunk] = best
    return out


def clip_groups(w: torch.Tensor, bounds: torch.Tensor, group_size: int) -> torch.Tensor:
    """w [N, K] clamped group-wise to [-bounds, bounds] (bounds [N, K // group_size])."""
    b = bounds.repeat_interleave(group_size, dim=1)
    return torch.maximum(torch.minimum(w.float(), b), -b)


def awq_quantize(w: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, min_zero: int = 0,
                 x: torch.Tensor | None = None) -> IntQuant:
    """Quantize ``w diag(scales)`` (the layer whose input is divided by ``scales``); with calibration inputs ``x``
    [M, K] (undivided), each group's range is clipped first (``search_clip``)."""
    ws = w.float() * scales.float()
    if x is not None:
        ws = clip_groups(ws, search_clip(ws, x.float() / scales.float(), bits, group_size, min_zero=min_zero),
                         group_size)
    return quantize_int(ws, bits, group_size, min_zero)
