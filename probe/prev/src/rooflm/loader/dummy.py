"""Random weights from a config alone, for benchmarking models whose weights are not on the machine.

Deterministic from ``seed`` on a given device, generated directly on the target device in the target dtype (no
host round trip, so a 7B model initialises in well under a second on a GPU): every matrix ~ normal(0, 0.02), every
norm weight = 1, every bias = 0.
"""
from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02,
                       device: torch.device | str | None = None) -> None:
    """``device``: where to draw the random numbers (default: where each weight lives). Weights kept elsewhere (in
    host memory, offloaded) are drawn there and copied, which on a GPU is far faster than the host's generator."""
    gen: torch.Generator | None = None
    for name, param in model.named_parameters():  # a tied weight is listed once
        where = torch.device(device) if device is not None else param.device
        if gen is None:
            gen = torch.Generator(device=where)
            gen.manual_seed(seed)
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        elif param.device == where:
            param.normal_(0.0, std, generator=gen)
        else:
            param.copy_(torch.empty(param.shape, dtype=param.dtype, device=where).normal_(0.0, std, generator=gen))
