"""Triton kernels for the GPU fast path, each with a plain-torch reference twin (``*_ref``) in the same file.

Kernels run on CUDA; on a CPU the same code runs under Triton's interpreter (``TRITON_INTERPRET=1``, set before
``triton`` is imported), which is how ``tests/kernels`` checks them in CI. Importing this package does not import
triton; each kernel module does.

The layers (``rooflm.layers``: linear, norm, activation) dispatch CUDA tensors to these kernels while
``enabled()``; ``ROOFLM_KERNELS=0`` in the environment, or ``set_enabled(False)`` / ``with disabled():``, keeps every
layer on its plain-torch path (the reference the GPU path is checked against). Attention follows the engine's
``attention_backend`` instead.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

_enabled = os.environ.get("ROOFLM_KERNELS", "1") != "0"


def enabled() -> bool:
    return _enabled


def set_enabled(flag: bool) -> None:
    global _enabled
    _enabled = bool(flag)


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Plain-torch layers inside the block (the reference path)."""
    old = _enabled
    set_enabled(False)
    try:
        yield
    finally:
        set_enabled(old)
