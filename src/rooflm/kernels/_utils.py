"""Small helpers shared by the kernel modules (no kernels here)."""
from __future__ import annotations

import functools
import os

import torch


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int = 0) -> int:
    if not torch.cuda.is_available():
        return 8  # the interpreter: small grids keep CPU tests fast
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(t: torch.Tensor) -> int:
    return num_sms(t.device.index or 0) if t.is_cuda else num_sms(0)


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension; its strides are {tuple(t.stride())}")
