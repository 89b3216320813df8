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

import importlib.util  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

HAVE_TRITON = importlib.util.find_spec("triton") is not None
_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without triton every kernel test is reported as skipped, with the reason, rather than left out unseen."""
    if HAVE_TRITON:
        return
    skip = pytest.mark.skip(reason="triton is not installed (`make test` installs it); kernel tests need it")
    for item in items:
        if _HERE in Path(str(item.fspath)).parents:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
