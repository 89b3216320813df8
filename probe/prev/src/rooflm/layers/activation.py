"""The gated activation of SwiGLU MLPs. The fused gate_up projection yields [gate | up] side by side."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rooflm.layers.custom_op import TRITON, CustomOp, OpSelection
from rooflm.layers.linear import GEMV_MAX_ROWS, Linear, fused_gemv_allowed_by_env
from rooflm.quantization.fp8 import QUANT_KERNEL_MAX_ROW as FP8_MAX_ROW
from rooflm.quantization.fp8 import silu_mul_fp8_linear


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [num_tokens, 2 * intermediate] laid out as [gate | up]. Returns silu(gate) * up:
    [num_tokens, intermediate]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(CustomOp):
    """``silu(gate) * up`` of a [gate | up] row. The Triton path reads the row once in one kernel
    (``rooflm/kernels/activation.py``); the reference path is ``silu_and_mul``."""

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)

    def forward_cuda(self, gate_up: torch.Tensor) -> torch.Tensor:
        from rooflm.kernels.activation import silu_and_mul as fused_silu_and_mul

        return fused_silu_and_mul(gate_up)

    def extra_repr(self) -> str:
        return f"impl={self.impl}"


class SiluAndMulLinear(CustomOp):
    """``proj(act(gate_up))``: the down projection of a SwiGLU MLP with its activation. Built over an existing
    ``SiluAndMul`` and ``Linear``, which keep their parameters (this op registers neither).

    The reference path calls the two modules in turn. The Triton path, at decode sizes, reads [gate | up] inside the
    projection's GEMV (``rooflm.kernels.fused_gemv.silu_mul_gemv``) where that was measured faster for the shape
    (``pick_silu_mul_gemv``); otherwise the two modules in turn, as always when ``proj`` holds a quantized weight."""

    def __init__(self, act: CustomOp, proj: Linear) -> None:
        super().__init__()
        if not isinstance(act, SiluAndMul):
            raise ValueError(f"act={type(act).__name__} is not supported: SiluAndMulLinear fuses SiluAndMul")
        self._parts = (act, proj)  # a plain tuple: not submodules, so no second name for their parameters

    def choose(self, selection: OpSelection) -> None:
        super().choose(selection)
        self.fuse = self.impl == TRITON and fused_gemv_allowed_by_env()

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        act, proj = self._parts
        return proj(act(gate_up))

    def forward_cuda(self, gate_up: torch.Tensor) -> torch.Tensor:
        _, proj = self._parts
        if self.fuse and proj.fp8_tensor_cores and gate_up.dim() == 2 and gate_up.shape[1] <= 2 * FP8_MAX_ROW:
            # fp8 W8A8: the activation's kernel writes the quantized input of the fp8 matmul
            return silu_mul_fp8_linear(gate_up, proj.fp8_weight, proj.bias)
        # a packed proj has no float weight for the fused GEMV to read: the activation, then the quantized matmul
        if self.fuse and not proj.quantized and gate_up.dim() == 2 and gate_up.shape[0] <= GEMV_MAX_ROWS:
            from rooflm.kernels.fused_gemv import pick_silu_mul_gemv, silu_mul_gemv

            cfg = pick_silu_mul_gemv(gate_up, proj.weight, proj.bias)
            if cfg is not None:
                return silu_mul_gemv(gate_up, proj.weight, proj.bias, cfg)
        return self.forward_native(gate_up)  # the two modules, each on the path it chose

    def extra_repr(self) -> str:
        return f"fuse={getattr(self, 'fuse', False)}, impl={self.impl}"


_ACTIVATIONS: dict[str, type[CustomOp]] = {"silu": SiluAndMul, "swish": SiluAndMul}


def get_gated_activation(name: str) -> CustomOp:
    """A new ``act(gate) * up`` module for a config's ``hidden_act`` (built under the active op selection)."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"hidden_act={name!r} is not supported: expected one of {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]()
