"""Kernel tests run on CUDA when present, else on the CPU under Triton's interpreter.

TRITON_INTERPRET must be set before triton (and so before any rooflm.kernels module) is imported: @triton.jit
decides at decoration time whether to build an interpreted function.
"""
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    if any(m == "rooflm.kernels" or m.startswith("rooflm.kernels.") for m in sys.modules if m != "rooflm.kernels"):
        raise RuntimeError("rooflm kernel modules were imported before tests/kernels/conftest.py could set "
                           "TRITON_INTERPRET=1; import them lazily in CPU test modules")

import pytest  # noqa: E402

if __import__("importlib").util.find_spec("triton") is None:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
