"""Tensor and pipeline parallelism over two GPUs (NCCL): the same greedy tokens as one GPU. Skips without two CUDA
devices.

float32 weights (the default GGUF dequantized) on the default GPU path (Triton kernels, asynchronous scheduling),
so a token can differ only where two logits nearly tie; the logprobs are compared within 1e-3."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA devices")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "List three colours:", "1, 1, 2, 3, 5, 8,", "The speed of light is"]


def _generate(tp: int, pp: int = 1) -> list[tuple[list[int], list[dict[int, float]]]]:
    from rooflm import LLM
    from rooflm.sampling_params import SamplingParams

    llm = LLM(None, quantization="none", dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp,
              show_progress=False,
              kv_cache_memory=256 * 2**20)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, logprobs=1), use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def one_gpu():
    return _generate(1)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_two_gpus_give_the_greedy_tokens_of_one(one_gpu, tp, pp):
    got = _generate(tp, pp)
    for (ref_ids, ref_lp), (ids, lp) in zip(one_gpu, got):
        assert ids == ref_ids
        for a, b in zip(ref_lp, lp):
            assert max(abs(a[t] - b[t]) for t in a) <= 1e-3
