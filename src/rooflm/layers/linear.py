"""Every weight projection of every model goes through ``apply_linear``.

One function on purpose: it is the single seam where a GPU engineer dispatches small batches (decode, a few tokens)
to a memory-bound GEMV kernel and large ones to a GEMM, or a quantized weight to its own kernel, without touching
any model file.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def apply_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``. x: [num_tokens, in_features]; weight: [out_features, in_features] (HF layout);
    bias: [out_features] or None. Returns [num_tokens, out_features] in x's dtype."""
    if x.is_cuda and x.shape[0] <= 16 and x.dim() == 2:
        # GPU fast path (issue 5): at <= 16 rows a GEMV / flat-GEMM Triton kernel, picked per shape by timing it
        # against F.linear (FlashDecoding++'s heuristic); see rooflm/kernels/gemv.py. CPU and larger batches: F.linear.
        from rooflm import kernels

        if kernels.enabled():
            from rooflm.kernels.gemv import linear as gemv_linear

            return gemv_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    """A weight (and optional bias) in HF layout, applied through ``apply_linear``. Parameters are allocated
    uninitialised (``torch.empty``): a loader or the dummy initialiser fills them, so building a 70B-shaped
    model on the target device costs no initialisation time."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
