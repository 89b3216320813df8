"""Prompt-lookup speculation on the CPU's lean path: the verify steps (one sequence, k + 1 new tokens) attend through
``rooflm.models.cpu_lean_seq`` and greedy output equals plain decoding; on the default GGUF model kept quantized, the
speculative run's tokens equal those of the same run with verify steps through the attention backend."""
from __future__ import annotations

import pytest
import torch

from rooflm.config import EngineConfig
from rooflm.engine.engine import LLMEngine
from rooflm.sampling_params import SamplingParams

from engine_utils import run, tokens

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "auto_disable": False}
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def echo_prompts(austen_ids) -> list[list[int]]:
    """One request at a time gets the verify steps of one sequence; passages that repeat give drafts."""
    return [austen_ids[40 * i: 40 * i + 40] + austen_ids[600:608] + austen_ids[40 * i: 40 * i + 10] for i in range(3)]


def _lean_module():
    """Imported when a test runs: the kernel tests' conftest must set TRITON_INTERPRET before any rooflm.kernels
    module is imported, and the lean loop imports the CPU kernels."""
    import rooflm.models.cpu_lean as lean_module

    return lean_module


def _seq_attention_calls(monkeypatch) -> list[int]:
    lean_module = _lean_module()
    calls = []
    real = lean_module.attend_seq

    def counting(*args):
        calls.append(args[2].shape[0])  # the step's new tokens
        return real(*args)

    monkeypatch.setattr(lean_module, "attend_seq", counting)
    return calls


def test_greedy_speculation_on_the_lean_path_equals_plain_decoding(monkeypatch, make_engine, echo_prompts):
    monkeypatch.setenv("ROOFLM_CPU_LEAN", "on")
    expected = [tokens(run(make_engine(), [p], PARAMS)) for p in echo_prompts]
    calls = _seq_attention_calls(monkeypatch)
    spec = make_engine(speculative_config=SPEC)
    got = [tokens(run(spec, [p], PARAMS)) for p in echo_prompts]
    assert got == expected
    assert spec.get_stats().spec_accepted_tokens > 0, "nothing was speculated"
    assert any(1 < n <= SPEC["num_speculative_tokens"] + 1 for n in calls), "no verify step took the lean path"


@pytest.fixture(scope="module")
def gguf_kept(smol):
    from rooflm.loader import load_model

    model, cfg = load_model(None, show_progress=False)  # the GGUF blocks kept quantized: packed int4 kernels
    return model, cfg, smol[2]


def test_gguf_verify_steps_give_the_backends_tokens(monkeypatch, gguf_kept, echo_prompts):
    model, cfg, tok = gguf_kept
    monkeypatch.setenv("ROOFLM_CPU_LEAN", "on")
    outs = []
    for seq_path in (True, False):
        if not seq_path:
            monkeypatch.setattr(_lean_module(), "seq_step_applies", lambda *args: False)
        calls = _seq_attention_calls(monkeypatch)
        engine = LLMEngine(EngineConfig(speculative_config=SPEC, kv_cache_memory=48 * 2**20, show_progress=False),
                           model=model, model_config=cfg, tokenizer=tok)
        with torch.inference_mode():
            outs.append([tokens(run(engine, [p], PARAMS)) for p in echo_prompts])
        assert engine.get_stats().spec_accepted_tokens > 0
        assert bool(calls) == seq_path
    assert outs[0] == outs[1]
