"""Engines over the embedded default model (SmolLM2-135M-Instruct), loaded once per session and shared.

Every engine made through ``make_engine`` is checked at the end of its test: no request left and every KV block
free (no leak)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rooflm.config import EngineConfig
from rooflm.engine.engine import LLMEngine

DATA = Path(__file__).parent.parent / "data"


@pytest.fixture(scope="session")
def smol():
    from rooflm.loader import load_model
    from rooflm.tokenizer import load_tokenizer

    # Dequantized to float32: these tests compare token streams across schedules (async and sync, preempted and not,
    # chunked and not), which is exact only while a token's logits do not depend on how its step was batched. The
    # GGUF blocks kept quantized round activations to bfloat16 for the CPU's integer kernels, which turns the tiny
    # float32 differences between a decode step and a recomputed prefill into different greedy choices at near-ties;
    # that path has its own tests (tests/models/test_smollm2_gguf.py, tests/quantization).
    model, cfg = load_model(None, dtype=torch.float32, device="cpu", show_progress=False, quantization="none")
    return model, cfg, load_tokenizer(None)


@pytest.fixture
def make_engine(smol):
    model, cfg, tok = smol
    made: list[LLMEngine] = []

    def make(**kw) -> LLMEngine:
        kw.setdefault("kv_cache_memory", 48 * 2**20)
        kw.setdefault("show_progress", False)
        engine = LLMEngine(EngineConfig(**kw), model=model, model_config=cfg, tokenizer=tok)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        assert not engine.has_unfinished_requests()
        assert engine.kv.num_free_blocks == engine.kv.num_blocks, "KV blocks leaked"
        assert not engine.kv.block_tables, "block tables left behind"


@pytest.fixture(scope="session")
def austen_ids(smol) -> list[int]:
    text = (DATA / "austen_pride_and_prejudice_ch1.txt").read_text()
    return smol[2](text)["input_ids"]


@pytest.fixture(scope="session")
def mixed_prompts(austen_ids) -> list[list[int]]:
    """32 prompts of 3 to ~120 tokens; every fourth shares a 40-token prefix with prompt 0 (prefix-cache food)."""
    prompts = []
    for i in range(32):
        length = 3 + (i * 37) % 118
        if i % 4 == 0:
            prompts.append(austen_ids[:40] + austen_ids[200 + i: 200 + i + length])
        else:
            start = (i * 53) % (len(austen_ids) - 130)
            prompts.append(austen_ids[start:start + length])
    return prompts
