"""The gated activation of SwiGLU MLPs. The fused gate_up projection yields [gate | up] side by side."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [num_tokens, 2 * intermediate] laid out as [gate | up]. Returns silu(gate) * up: [num_tokens, intermediate]."""
    if gate_up.is_cuda:
        # GPU fast path (issue 5): one Triton kernel reading [gate | up] once; rooflm/kernels/activation.py
        from rooflm import kernels

        if kernels.enabled():
            from rooflm.kernels.activation import silu_and_mul as fused_silu_and_mul

            return fused_silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


_ACTIVATIONS = {"silu": silu_and_mul, "swish": silu_and_mul}


def get_gated_activation(name: str):
    """The ``act(gate) * up`` function of a config's ``hidden_act``."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"hidden_act={name!r} is not supported: expected one of {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]
