"""RMSNorm, alone and fused with the residual add that precedes it in every pre-norm decoder layer.

The torch functions here are the reference; a fused GPU kernel slots in behind the same signatures.
"""
from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [num_tokens, hidden]. Normalises in float32, casts back to x's dtype, then scales (HF Llama's order)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual; return rms_norm(residual), residual``. Both [num_tokens, hidden]."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: the normalised x. With it: (normalised x + residual, the new residual)."""
        if x.is_cuda:
            # GPU fast path (issue 5): one Triton kernel for add + norm, same roundings; rooflm/kernels/rmsnorm.py
            from rooflm import kernels

            if kernels.enabled():
                from rooflm.kernels.rmsnorm import rms_norm as fused_rms_norm

                return fused_rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
