"""Tensor parallelism over two GPUs (NCCL): the same greedy tokens as one GPU. Skips without two CUDA devices.

float32 weights (the default GGUF dequantized) on the default GPU path (Triton kernels, asynchronous scheduling),
so a token differs only at a near-tie of two logits, which these prompts do not have."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA devices")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "List three colours:", "1, 1, 2, 3, 5, 8,", "The speed of light is"]


def _generate(tp: int) -> list[tuple[list[int], list[dict[int, float]]]]:
    from rooflm import LLM
    from rooflm.sampling_params import SamplingParams

    llm = LLM(None, quantization="none", dtype="float32", tensor_parallel_size=tp, show_progress=False,
              kv_cache_memory=256 * 2**20)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, logprobs=1), use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    finally:
        llm.shutdown()


def test_tp2_greedy_tokens_equal_tp1_on_two_gpus():
    ref = _generate(1)
    got = _generate(2)
    for (ref_ids, ref_lp), (ids, lp) in zip(ref, got):
        assert ids == ref_ids
        for a, b in zip(ref_lp, lp):
            assert max(abs(a[t] - b[t]) for t in a) <= 1e-3
