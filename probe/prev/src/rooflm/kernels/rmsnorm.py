# RMSNorm, optionally fused with the residual add that precedes it in every pre-norm transformer block.
#
# Technique: RMSNorm (Zhang & Sennrich 2019): y = x / sqrt(mean(x^2) + eps) * weight. Fusing the residual add
# (as in FasterTransformer / vLLM's fused_add_rms_norm) makes one pass over the row instead of three (add, read for
# the norm, write): memory-bound decode spends its time moving bytes, so fewer passes are faster.
#
# Shapes and invariants: x, residual [num_tokens, hidden] (last dim contiguous); weight [hidden].
# Semantics follow Hugging Face's LlamaRMSNorm: the sum x + residual is rounded to x's dtype (it is the new residual
# stream), the statistic is taken in float32, the normalised row is rounded to x's dtype and then scaled by weight.
# One program per row; the row fits one block (hidden <= 65536).
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rooflm.kernels._utils import check_last_dim_contiguous, next_pow2


@triton.jit
def add_rmsnorm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, stride_x, stride_r, stride_ro, offs, mask, n_cols, eps,
                    HAS_RESIDUAL: tl.constexpr):
    """One row of the (add +) RMSNorm in x's dtype, masked lanes 0; with HAS_RESIDUAL the sum x + residual is
    stored as the new residual stream. Shared with the fp8 kernels that quantize the norm's output
    (``rooflm/kernels/fp8_quant.py``), so both round alike."""
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n_cols
    y = (xf * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    return (w.to(tl.float32) * y.to(tl.float32)).to(x_ptr.dtype.element_ty)


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    o = add_rmsnorm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, stride_x, stride_r, stride_ro, offs, mask, n_cols,
                        eps, HAS_RESIDUAL)
    tl.store(out_ptr + row * stride_o + offs, o.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Without residual: the normalised x. With residual: (norm(x + residual), x + residual)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    check_last_dim_contiguous("x", x2)
    n_rows, n_cols = x2.shape
    out = torch.empty_like(x2)
    if residual is not None:
        r2 = residual.reshape(-1, shape[-1])
        check_last_dim_contiguous("residual", r2)
        res_out = torch.empty_like(x2)
    else:
        r2, res_out = x2, out
    if n_rows:
        block = next_pow2(n_cols)
        warps = 4 if block <= 2048 else (8 if block <= 8192 else 16)
        _rmsnorm_kernel[(n_rows,)](
            x2, r2, weight, out, res_out, x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
            n_cols, float(eps), HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=warps,
        )
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)


def rms_norm_ref(x, weight, eps, residual=None):
    """The twin, in Hugging Face's order of roundings."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = (weight.float() * y.float()).to(x.dtype)
    return out if residual is None else (out, x)
