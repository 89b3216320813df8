"""Structured output on the GPU (CUDA graphs, asynchronous scheduling on): sampled constrained outputs follow their
JSON schema / regex in a batch with plain requests, and the plain requests run their full length. Skipped without
CUDA. (Token-for-token equality of plain rows with and without grammar rows is checked on the CPU, in
tests/engine/test_structured_output.py: bfloat16 GEMMs on the GPU may round differently at another batch size.)"""
from __future__ import annotations

import json
import os
import re

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["a", "ok"], "additionalProperties": False}
REGEX = r"[a-z]{1,3}-[0-9]{1,2}"


def _llm(**kw):
    """The default model; where its package is not installed (a bare GPU machine), the same architecture with random
    weights and the tokenizer saved from it (``ROOFLM_TEST_TOKENIZER``: a folder written by save_pretrained)."""
    from rooflm import LLM

    try:
        from rooflm.loader.default_model import default_model_path

        default_model_path()
        return LLM(None, **kw)
    except (FileNotFoundError, ImportError):
        folder = os.environ.get("ROOFLM_TEST_TOKENIZER")
        if not folder:
            pytest.skip("neither the default model nor ROOFLM_TEST_TOKENIZER is available")
        return LLM("smollm2-135m", load_format="dummy", tokenizer=folder, **kw)


def _check_schema(text: str) -> None:
    """SCHEMA, checked by hand (the GPU machine has no jsonschema)."""
    obj = json.loads(text)
    assert set(obj) == {"a", "ok"}, text
    assert type(obj["a"]) is int and 0 <= obj["a"] <= 99 and type(obj["ok"]) is bool, text


def test_constrained_and_plain_requests_on_the_gpu():
    from rooflm import SamplingParams

    llm = _llm(max_num_seqs=64, max_model_len=512, async_scheduling=True, show_progress=False)
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Tell me about item {i}."}], tokenize=False,
                                       add_generation_prompt=True) for i in range(40)]
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    params = [plain] * 8 + [SamplingParams(temperature=1.0, seed=i, max_tokens=24,
                                           structured_outputs={"json": SCHEMA} if i % 2 else {"regex": REGEX})
                            for i in range(32)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs[:8]] == [16] * 8
    assert llm.engine.runner.graph_runner is None or llm.engine.runner.graph_runner.replays > 0
    for i, o in enumerate(outs[8:]):
        text = o.outputs[0].text
        assert o.outputs[0].finish_reason == "stop", text
        if i % 2:
            _check_schema(text)
        else:
            assert re.fullmatch(REGEX, text), text
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
