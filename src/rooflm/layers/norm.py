"""RMSNorm, alone and fused with the residual add that precedes it in every pre-norm decoder layer; and
``RMSNormLinear``, the norm followed by the projection that reads it.

The torch functions here are the reference (``forward_native``); ``forward_cuda`` runs one Triton kernel for the add
and the norm with the same roundings (``rooflm/kernels/rmsnorm.py``). ``RMSNormLinear`` on the Triton path runs the
add, the norm and the projection as one GEMV launch at decode sizes (``rooflm/kernels/fused_gemv.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rooflm.distributed.parallel_state import tp_all_reduce, tp_all_reduce_rms_norm
from rooflm.kernels.cpu_native.ops import rms_norm as native_rms_norm
from rooflm.layers.custom_op import TRITON, CustomOp, OpSelection
from rooflm.layers.linear import GEMV_MAX_ROWS, Linear, fused_gemv_allowed_by_env
from rooflm.quantization.fp8 import QUANT_KERNEL_MAX_ROW as FP8_MAX_ROW
from rooflm.quantization.fp8 import rms_norm_fp8_linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [num_tokens, hidden]. Normalises in float32, casts back to x's dtype, then scales (HF Llama's order)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def cpu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm on the CPU path: the native operator for float32 (one call, ``rooflm.kernels.cpu_native.ops``), else
    torch's fused ``rms_norm``. The module forward and the lean decoder loop both call this, so they agree."""
    out = native_rms_norm(x, weight, eps)
    return out if out is not None else F.rms_norm(x, weight.shape, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual; return rms_norm(residual), residual``. Both [num_tokens, hidden]."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


@dataclass
class NormHandoff:
    """What a decoder layer passes on instead of (hidden, residual) where its last projection already did the
    residual add before the next norm (one decode row, the Triton path; ``rooflm/kernels/handoff_gemv.py``):
    ``residual`` is the new residual stream (x + residual, rounded as the add + norm kernel rounds it), ``scaled``
    residual * the next norm's weight (rounded), ``sumsq`` float32 partial sums of residual^2 (the norm's statistic,
    still to be added up) and ``config`` the GEMV configuration measured for the projection after the norm. Only
    ``RMSNormLinear.from_handoff`` takes one: a layer hands over only to the next layer of its pipeline stage."""

    residual: torch.Tensor
    scaled: torch.Tensor
    sumsq: torch.Tensor
    config: object  # rooflm.kernels.gemv.GemvConfig (not imported here: kernels load lazily)


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

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``cpu_rms_norm``: the native operator in float32, else torch's fused ``rms_norm`` (one op instead of
        six), which scales by the weight before the final rounding, so in bfloat16 it may differ from the reference
        by one unit in the last place; float32 agrees to rounding."""
        if residual is None:
            return cpu_rms_norm(x, self.weight, self.eps)
        residual = x + residual
        return cpu_rms_norm(residual, self.weight, self.eps), residual

    def forward_cuda(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from rooflm.kernels.rmsnorm import rms_norm as fused_rms_norm

        return fused_rms_norm(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        return f"hidden={self.weight.shape[0]}, eps={self.eps}, impl={self.impl}"


class RMSNormLinear(CustomOp):
    """``proj(norm(x))``, or with ``residual``: (proj(norm(x + residual)), x + residual); without residual the
    second value is x itself. Built over an existing ``RMSNorm`` and ``Linear``, which keep their parameters (and
    their names, and weight loading): this op registers neither.

    The reference path calls the two modules in turn, as an unfused layer does. The Triton path, at decode sizes,
    runs the add, the norm and the projection as one GEMV (``rooflm.kernels.fused_gemv.rmsnorm_gemv``) where that
    was measured faster for the shape (``pick_rmsnorm_gemv``); otherwise the two modules in turn, as always when
    ``proj`` holds a quantized weight."""

    def __init__(self, norm: RMSNorm, proj: Linear) -> None:
        super().__init__()
        if norm.weight.shape[0] != proj.in_features:
            raise ValueError(f"norm hidden size {norm.weight.shape[0]} does not match proj.in_features "
                             f"{proj.in_features}")
        self._parts = (norm, proj)  # a plain tuple: not submodules, so no second name for their parameters

    def choose(self, selection: OpSelection) -> None:
        super().choose(selection)
        self.fuse = self.impl == TRITON and fused_gemv_allowed_by_env()

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        norm, proj = self._parts
        if residual is None:
            return proj(norm(x)), x
        h, residual = norm(x, residual)
        return proj(h), residual

    def forward_cuda(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        norm, proj = self._parts
        if self.fuse and proj.fp8_tensor_cores and x.dim() == 2 and x.shape[1] <= FP8_MAX_ROW and (
                residual is None or residual.shape == x.shape):
            # fp8 W8A8: the norm's kernel writes the quantized activations the fp8 matmul reads
            return rms_norm_fp8_linear(x, norm.weight, norm.eps, residual, proj.fp8_weight, proj.bias)
        # a packed proj has no float weight for the fused GEMV to read: norm, then the quantized matmul
        if self.fuse and not proj.quantized and x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS:
            from rooflm.kernels.fused_gemv import pick_rmsnorm_gemv, rmsnorm_gemv

            pick = pick_rmsnorm_gemv(x, proj.weight, proj.bias, norm.eps)
            if pick is not None and (residual is None or residual.shape == x.shape):
                cfg, one_pass = pick
                return rmsnorm_gemv(x, norm.weight, norm.eps, proj.weight, proj.bias, cfg, residual, one_pass)
        return self.forward_native(x, residual)  # the two modules, each on the path it chose

    def from_handoff(self, hand: NormHandoff, silu_mul: bool = False, pdl_trigger: int = 0,
                     pdl_wait: bool = False, pdl_preload: bool = False) -> torch.Tensor:
        """proj(norm(hand.residual)) in one launch from ``hand.scaled``, the statistic from the partial sums the
        previous projection left (``rmsnorm_sumsq_gemv``); with ``silu_mul`` silu(gate) * up of it (``proj``: a [gate
        | up] projection). Programmatic dependent launch (``rooflm.kernels.gemv.launch_gemv``): ``pdl_trigger`` lets
        the next kernel, launched that way, be scheduled early (``TRIGGER_START`` / ``TRIGGER_LATE``); with
        ``pdl_wait`` this one is launched that way and waits for the kernel before it in place; ``pdl_preload`` loads
        its first weight tile before the wait (where K is whole tiles)."""
        from rooflm.kernels.handoff_gemv import rmsnorm_sumsq_gemv

        norm, proj = self._parts
        if proj.quantized:
            from rooflm.kernels.handoff_gemv import packed_rmsnorm_sumsq_gemv

            return packed_rmsnorm_sumsq_gemv(hand.scaled, hand.sumsq, norm.eps, proj.packed_weight, proj.bias,
                                             hand.config, silu_mul=silu_mul, pdl_trigger=pdl_trigger,
                                             pdl_wait=pdl_wait, pdl_preload=pdl_preload)
        return rmsnorm_sumsq_gemv(hand.scaled, hand.sumsq, norm.eps, proj.weight, proj.bias, hand.config,
                                  silu_mul=silu_mul, pdl_trigger=pdl_trigger, pdl_wait=pdl_wait,
                                  pdl_preload=pdl_preload)

    def handoff_ready(self) -> bool:
        """Whether ``from_handoff`` can run this op: the Triton path with fusions allowed, a float or packed weight."""
        proj = self._parts[1]
        return (getattr(self, "fuse", False) and not proj.fp8_tensor_cores
                and (not proj.quantized or proj.packed_weight is not None))

    def norm_gemv_silu_mul(self, x: torch.Tensor,
                           residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(silu(gate) * up of proj(norm(x + residual)), x + residual) in one GEMV launch (``proj``: a [gate | up]
        projection), where the Triton path runs one row with a float weight and that was measured faster than the
        norm kernel followed by the projection with its activation; None otherwise (the caller runs the parts)."""
        norm, proj = self._parts
        if not (self.fuse and not proj.quantized and not proj.fp8_tensor_cores and x.dim() == 2 and x.shape[0] == 1
                and residual is not None and residual.shape == x.shape):
            return None
        from rooflm.kernels.fused_gemv import pick_rmsnorm_gemv_silu_mul, rmsnorm_gemv

        pick = pick_rmsnorm_gemv_silu_mul(x, proj.weight, proj.bias, norm.eps)
        if pick is None:
            return None
        cfg, one_pass = pick
        return rmsnorm_gemv(x, norm.weight, norm.eps, proj.weight, proj.bias, cfg, residual, one_pass, silu_mul=True)

    def extra_repr(self) -> str:
        return f"fuse={getattr(self, 'fuse', False)}, impl={self.impl}"


class AllReduceRMSNorm(CustomOp):
    """``norm(all_reduce(x) + residual)`` over the tensor-parallel group: returns (that, all_reduce(x) + residual).

    Under tensor parallelism a decoder layer's attention and MLP outputs are partial sums (row-parallel
    projections) that the next norm needs whole. The reference path all-reduces, then calls the norm; the Triton
    path does the all-reduce, the add and the norm in one kernel where the one-shot communicator takes the rows
    (``rooflm/kernels/lamport_all_reduce.py``; TensorRT-LLM fuses the same three), else the same two steps. Built
    over an existing ``RMSNorm``, which keeps its parameter (this op registers none)."""

    def __init__(self, norm: RMSNorm) -> None:
        super().__init__()
        self._parts = (norm,)  # a plain tuple: not a submodule, so no second name for its parameter

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._parts[0](tp_all_reduce(x), residual)

    def forward_cuda(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        norm = self._parts[0]
        fused = tp_all_reduce_rms_norm(x, residual, norm.weight, norm.eps)
        return fused if fused is not None else self.forward_native(x, residual)

    def extra_repr(self) -> str:
        return f"impl={self.impl}"
