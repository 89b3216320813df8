"""RMSNorm, alone and fused with the residual add that precedes it in every pre-norm decoder layer.

The torch functions here are the reference (``forward_native``); ``forward_cuda`` runs one Triton kernel for the add
and the norm with the same roundings (``rooflm/kernels/rmsnorm.py``).
"""
from __future__ import annotations

import torch
from torch import nn

from rooflm.layers.custom_op import CustomOp


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


class RMSNorm(CustomOp):
    """``norm(x)``, or with ``residual``: (norm(x + residual), x + residual)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)

    def forward_cuda(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from rooflm.kernels.rmsnorm import rms_norm as fused_rms_norm

        return fused_rms_norm(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        return f"hidden={self.weight.shape[0]}, eps={self.eps}, impl={self.impl}"
