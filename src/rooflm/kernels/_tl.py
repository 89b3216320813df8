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


# The residual add and RMSNorm statistic handed from one projection to the next (rooflm/kernels/handoff_gemv.py)
@triton.jit
def rstd_from_partials(ss_ptr, n_ss, K, eps, SS_BLOCK: tl.constexpr):
    """1 / rms of a row of K from the partial sums of its squares that ``add_sumsq_store`` left."""
    offs = tl.arange(0, SS_BLOCK)
    return tl.rsqrt(tl.sum(tl.load(ss_ptr + offs, mask=offs < n_ss, other=0.0), 0) / K + eps)


@triton.jit
def add_sumsq_store(out_ptr, acc, offs_n, mask_n, pid, r_ptr, nw_ptr, ro_ptr, ss_ptr):
    """EPI 2: h = sums rounded + residual, rounded (the add + norm kernel's residual stream) stored at ro_ptr;
    h * norm_weight rounded (the next GEMV's input before 1/rms) at out_ptr; sum(h^2) of these rows at ss_ptr[pid]."""
    dt = out_ptr.dtype.element_ty
    r = tl.load(r_ptr + offs_n, mask=mask_n, other=0.0)
    h = (acc.to(dt).to(tl.float32) + r.to(tl.float32)).to(dt)
    tl.store(ro_ptr + offs_n, h, mask=mask_n)
    hf = tl.where(mask_n, h.to(tl.float32), 0.0)
    nw = tl.load(nw_ptr + offs_n, mask=mask_n, other=0.0)
    tl.store(out_ptr + offs_n, (hf * nw.to(tl.float32)).to(dt), mask=mask_n)
    tl.store(ss_ptr + pid, tl.sum(hf * hf, 0))
