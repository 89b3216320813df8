"""Pipeline parallelism over two CPU processes (gloo): the same tokens and logprobs as one process.

The tiny checkpoint (2 layers, one per stage, untied head) and SmolLM2-135M (30 layers, 15 per stage, LM head tied to
the embedding, so the last stage keeps a copy of the embedding) in float32."""
from __future__ import annotations

import pytest

from rooflm.config import EngineConfig
from rooflm.sampling_params import SamplingParams
from test_tp_engine import PROMPTS, _assert_same
from tp_helpers import run


def test_tiny_model_pp2_equals_pp1(make_engine, tiny_checkpoint):
    greedy = SamplingParams(max_tokens=10, temperature=0, logprobs=3, prompt_logprobs=2)
    seeded = [SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=7 + i, logprobs=1) for i in range(3)]
    ref_engine = make_engine(model=tiny_checkpoint)
    ref_greedy = run(ref_engine, PROMPTS, greedy)
    ref_seeded = run(ref_engine, PROMPTS[:3], seeded)
    pp = make_engine(model=tiny_checkpoint, pipeline_parallel_size=2)
    # rank 0 is the first stage: the embedding and layer 0, no LM head
    m = pp.model
    assert (m.model.start_layer, m.model.end_layer, m.lm_head) == (0, 1, None)
    assert len(pp.runner.kv_caches) == 1
    _assert_same(ref_greedy, run(pp, PROMPTS, greedy), tol=1e-5)
    _assert_same(ref_seeded, run(pp, PROMPTS[:3], seeded), tol=1e-5)


@pytest.mark.slow
def test_default_model_pp2_with_chunked_prefill_equals_pp1(make_engine):
    from rooflm.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    texts = ["The capital of France is", "It is a truth universally acknowledged, that a single man in possession",
             "def fibonacci(n):\n    ", "1, 1, 2, 3, 5, 8, 13,"]
    prompts = [tok(t)["input_ids"] for t in texts]
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=2, prompt_logprobs=1)
    ref = run(make_engine(quantization="none"), prompts, params)
    got = run(make_engine(quantization="none", pipeline_parallel_size=2, max_num_batched_tokens=8), prompts, params)
    # chunked against whole prompts: a short chunk after a cached prefix attends token by token, a long prompt
    # through torch's fused kernel (attention/cpu_backend.py), so the two runs round differently (each within float32
    # rounding of exact attention), and 30 layers amplify it
    _assert_same(ref, got, tol=2e-5)


@pytest.mark.parametrize("kw", [dict(pipeline_parallel_size=0), dict(pipeline_parallel_size=-2, tensor_parallel_size=2)])
def test_bad_pipeline_settings_are_value_errors_naming_the_field(kw):
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        EngineConfig(**kw)


def test_more_stages_than_layers_is_refused_before_any_worker_starts(make_engine, tiny_checkpoint):
    with pytest.raises(ValueError, match="pipeline_parallel_size=3"):
        make_engine(model=tiny_checkpoint, pipeline_parallel_size=3)
