"""The gated activation of SwiGLU MLPs. The fused gate_up projection yields [gate | up] side by side."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rooflm.layers.custom_op import CustomOp


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [num_tokens, 2 * intermediate] laid out as [gate | up]. Returns silu(gate) * up: [num_tokens, intermediate]."""
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


_ACTIVATIONS: dict[str, type[CustomOp]] = {"silu": SiluAndMul, "swish": SiluAndMul}


def get_gated_activation(name: str) -> CustomOp:
    """A new ``act(gate) * up`` module for a config's ``hidden_act`` (built under the active op selection)."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"hidden_act={name!r} is not supported: expected one of {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]()
