"""Random weights from a config alone, for benchmarking models whose weights are not on the machine.

Deterministic from ``seed`` on a given device, generated directly on the target device in the target dtype (no
host round trip, so a 7B model initialises in well under a second on a GPU): every matrix ~ normal(0, 0.02), every
norm weight = 1, every bias = 0.
"""
from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    gens: dict[torch.device, torch.Generator] = {}  # one per device (weights offloaded to the host: two)
    for name, param in model.named_parameters():  # a tied weight is listed once
        gen = gens.get(param.device)
        if gen is None:
            gen = gens[param.device] = torch.Generator(device=param.device)
            gen.manual_seed(seed)
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, std, generator=gen)
