"""Device helpers shared by the kernels."""
import torch
import triton
import triton.language as tl

from rooflm.kernels._utils import interpreting


@triton.jit
def dot(a, b, UPCAST: tl.constexpr):
    """tl.dot, or in float32 when UPCAST: Triton 3.9's CPU interpreter computes bfloat16 tl.dot wrongly, so the
    interpreter runs bf16 products in float32 (the compiled GPU path never sets UPCAST)."""
    if UPCAST:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        r = tl.dot(a, b)
    return r


def dot_upcast(dtype: torch.dtype) -> bool:
    return interpreting() and dtype == torch.bfloat16
