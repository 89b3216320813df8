"""Fixtures for the tensor-parallel tests: a tiny random Llama checkpoint that exercises every uneven case (one KV
head replicated on both ranks, an odd vocabulary, q/k/v, o_proj and MLP biases), and TP=1 reference engines.

Every tensor-parallel engine a test starts is shut down at the end of that test, so no worker outlives it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rooflm.config import EngineConfig
from rooflm.engine.engine import LLMEngine

from tp_helpers import TINY  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    """A safetensors folder of random weights (non-zero biases too), written under Hugging Face names."""
    from safetensors.torch import save_file

    from rooflm.loader import load_model

    folder = tmp_path_factory.mktemp("tiny-tp")
    (folder / "config.json").write_text(json.dumps(TINY))
    model, _ = load_model(str(folder), load_format="dummy", seed=3, show_progress=False)
    g = torch.Generator().manual_seed(4)
    tensors = {}
    for name, target in model.weight_targets().items():
        t = target.view().clone().contiguous()
        if name.endswith(".bias"):
            t = torch.randn(t.shape, generator=g) * 0.1
        tensors[name] = t
    save_file(tensors, str(folder / "model.safetensors"))
    return str(folder)


@pytest.fixture
def make_engine():
    """LLMEngine(EngineConfig(**kw)) on the CPU in float32; tensor-parallel ones are shut down afterwards."""
    made: list[LLMEngine] = []

    def make(**kw) -> LLMEngine:
        kw.setdefault("show_progress", False)
        kw.setdefault("dtype", "float32")
        kw.setdefault("device", "cpu")
        kw.setdefault("kv_cache_memory", 16 * 2**20)
        engine = LLMEngine(EngineConfig(**kw))
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.shutdown()
    from rooflm.distributed.parallel_state import get_state

    assert get_state() is None, "the process group was left behind"


@pytest.fixture(scope="session")
def data_path() -> Path:
    return Path(__file__).parent.parent / "data"
