"""Device helpers shared by the kernels."""
import os

import torch
import triton
import triton.language as tl

from rooflm.kernels._utils import interpreting

try:  # griddepcontrol (programmatic dependent launch); absent from older Triton releases
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_GDC = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAS_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch needs a Hopper-or-newer GPU and a Triton with griddepcontrol."""
    if device.type != "cuda" or interpreting() or not HAS_GDC:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def decode_pdl_enabled() -> bool:
    """``ROOFLM_DECODE_PDL`` (default 1): whether one-row decode launches decode attention with programmatic dependent
    launch, its qkv projection letting it be scheduled early, and the projections after it (handed-over norms) waiting
    in place for the kernel before each (see ``rooflm/kernels/handoff_gemv.py``); 0 turns it off."""
    value = os.environ.get("ROOFLM_DECODE_PDL", "1")
    if value not in ("0", "1"):
        raise ValueError(f"ROOFLM_DECODE_PDL must be 0 or 1; got {value!r}")
    return value == "1"


def pdl_launch(trigger: int, wait: bool, device: torch.device) -> tuple[int, bool, dict]:
    """(TRIGGER, WAIT, launch options) for a kernel that calls ``pdl_edges``: 0, False and no option where the
    device cannot launch that way (CPU, the interpreter, GPUs before Hopper). Called on every GEMV launch, so the
    device is only asked when a flag is set."""
    if not (trigger or wait) or not pdl_supported(device):
        return 0, False, {}
    return int(trigger), wait, {"launch_pdl": True} if wait else {}


@triton.jit
def pdl_edges(TRIGGER: tl.constexpr, WAIT: tl.constexpr):
    """At a program's start: TRIGGER 1 (``_utils.TRIGGER_START``) lets a kernel launched next with programmatic
    dependent launch be scheduled now (it waits for this grid before it reads what this grid writes); WAIT (the
    kernel was launched that way) waits for the kernel before to finish, so nothing after it reads a value that
    kernel has not written yet."""
    if TRIGGER == 1:
        gdc_launch_dependents()
    if WAIT:
        gdc_wait()


@triton.jit
def pdl_trigger_late(TRIGGER: tl.constexpr):
    """After a program's main loop: TRIGGER 2 (``_utils.TRIGGER_LATE``) lets the next kernel be scheduled once every
    program is past it."""
    if TRIGGER == 2:
        gdc_launch_dependents()


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


# The residual add and RMSNorm statistic handed from one projection to the next (rooflm/kernels/handoff_gemv.py).
# The loads that do not depend on a program's products (the previous kernel's partial sums, the residual rows and
# the norm weight) are issued before the main loop and used after it: a load stalls only at its first use, so the
# L2 round trip overlaps the weight stream instead of lengthening the last programs of the grid.
@triton.jit
def sumsq_partials(ss_ptr, n_ss, SS_BLOCK: tl.constexpr):
    """The partial sums of squares that ``add_sumsq_store`` left (SS_BLOCK >= n_ss of them, the rest 0)."""
    offs = tl.arange(0, SS_BLOCK)
    return tl.load(ss_ptr + offs, mask=offs < n_ss, other=0.0)


@triton.jit
def rstd_of_partials(parts, K, eps):
    """1 / rms of a row of K from ``sumsq_partials``."""
    return tl.rsqrt(tl.sum(parts, 0) / K + eps)


@triton.jit
def add_sumsq_inputs(r_ptr, nw_ptr, offs_n, mask_n):
    """The residual rows and norm weight that ``add_sumsq_store`` combines with the sums."""
    return tl.load(r_ptr + offs_n, mask=mask_n, other=0.0), tl.load(nw_ptr + offs_n, mask=mask_n, other=0.0)


@triton.jit
def add_sumsq_store(out_ptr, acc, offs_n, mask_n, pid, r, nw, ro_ptr, ss_ptr):
    """EPI 2: h = sums rounded + residual r, rounded (the add + norm kernel's residual stream) stored at ro_ptr;
    h * norm_weight rounded (the next GEMV's input before 1/rms) at out_ptr; sum(h^2) of these rows at ss_ptr[pid].
    r and nw from ``add_sumsq_inputs``."""
    dt = out_ptr.dtype.element_ty
    h = (acc.to(dt).to(tl.float32) + r.to(tl.float32)).to(dt)
    tl.store(ro_ptr + offs_n, h, mask=mask_n)
    hf = tl.where(mask_n, h.to(tl.float32), 0.0)
    tl.store(out_ptr + offs_n, (hf * nw.to(tl.float32)).to(dt), mask=mask_n)
    tl.store(ss_ptr + pid, tl.sum(hf * hf, 0))
