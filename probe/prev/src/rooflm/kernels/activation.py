# SiLU-and-multiply: the gated activation of a SwiGLU MLP (Shazeer 2020, "GLU Variants Improve Transformer").
#
# With the gate and up projections fused into one GEMM, its output row holds [gate | up]; this kernel reads it once
# and writes silu(gate) * up, where the unfused form reads and writes the intermediate three times.
#
# Shapes: x [num_tokens, 2 * d] (last dim contiguous) -> out [num_tokens, d]. silu(g) = g * sigmoid(g), computed in
# float32; as in Hugging Face's LlamaMLP, silu(gate) is rounded to x's dtype before the product.
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rooflm.kernels._utils import check_last_dim_contiguous


@triton.jit
def silu_mul_row(x_ptr, row, stride_x, offs, mask, d):
    """silu(gate) * up at columns ``offs`` of one [gate | up] row, in x's dtype (masked lanes 0). Shared with the
    fp8 kernel that quantizes it (``rooflm/kernels/fp8_quant.py``), so both round alike."""
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + d + offs, mask=mask, other=0.0)
    a = (g / (1.0 + tl.exp(-g))).to(x_ptr.dtype.element_ty)
    return (a.to(tl.float32) * u.to(tl.float32)).to(x_ptr.dtype.element_ty)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    tl.store(out_ptr + row * stride_o + offs, silu_mul_row(x_ptr, row, stride_x, offs, mask, d).to(
        out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    shape = x.shape
    if shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dimension ([gate | up]); got {tuple(shape)}")
    x2 = x.reshape(-1, shape[-1])
    check_last_dim_contiguous("x", x2)
    d = shape[-1] // 2
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = 1024
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](x2, out, x2.stride(0), out.stride(0), d,
                                                                    BLOCK=block, num_warps=4)
    return out.view(*shape[:-1], d)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return (torch.nn.functional.silu(x[..., :d].float()).to(x.dtype).float() * x[..., d:].float()).to(x.dtype)
