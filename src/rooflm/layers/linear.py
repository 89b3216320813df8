"""Weight projections. Every ``Linear`` (and the LM head, and the MoE experts) multiplies through one of two functions:

- ``linear_native``: ``F.linear``, the reference;
- ``linear_triton``: at <= 16 rows (decode, a few tokens) a GEMV / flat-GEMM Triton kernel, picked per shape by timing
  it against ``F.linear`` (FlashDecoding++'s heuristic, ``rooflm/kernels/gemv.py``); ``F.linear`` above.

Which of the two a layer uses is chosen once, at construction (``rooflm.layers.custom_op``); only the row-count test
inside ``linear_triton`` runs per call, since it depends on the batch.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from rooflm.layers.custom_op import CustomOp

GEMV_MAX_ROWS = 16  # at most this many rows go to the GEMV kernels; a GEMM wins above


def fused_gemv_allowed_by_env() -> bool:
    """``ROOFLM_FUSED_GEMV=off`` keeps the fused projections of the Triton path (``RMSNormLinear``,
    ``SiluAndMulLinear``) on their unfused pairs. Read when an op chooses its implementation; the other values
    ("auto", "on") are read by ``rooflm.kernels.fused_gemv``."""
    return os.environ.get("ROOFLM_FUSED_GEMV", "auto") != "off"


def linear_native(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``. x: [num_tokens, in_features]; weight: [out_features, in_features] (HF layout);
    bias: [out_features] or None. Returns [num_tokens, out_features] in x's dtype."""
    return F.linear(x, weight, bias)


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as ``linear_native``; small batches go to the GEMV kernels."""
    if x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS:
        from rooflm.kernels.gemv import linear as gemv_linear

        return gemv_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(CustomOp):
    """A weight (and optional bias) in HF layout. Parameters are allocated uninitialised (``torch.empty``): a loader
    or the dummy initialiser fills them, so building a 70B-shaped model on the target device costs no
    initialisation time."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return linear_native(x, self.weight, self.bias)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        return linear_triton(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"impl={self.impl}")
