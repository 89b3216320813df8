"""Quantized KV cache on the GPU: the compiled kernels against their twins at model-sized shapes, and the engine
with an int8 / fp8 cache and CUDA graphs giving the tokens of eager execution. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

KV = ["int8", "fp8"]


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("num_heads,num_kv_heads,dtype", [(32, 8, torch.bfloat16), (32, 32, torch.float16)])
def test_decode_quantized_model_shapes(kv, num_heads, num_kv_heads, dtype):
    from kernel_checks import check_decode

    check_decode(num_heads, num_kv_heads, 128, 16, [1, 1000, 4097, 33, 0], dtype=dtype, device="cuda", seed=3,
                 kv_cache_dtype=kv)


@pytest.mark.parametrize("kv", KV)
def test_prefill_quantized_model_shapes(kv):
    from kernel_checks import check_prefill

    check_prefill(32, 8, 128, 16, [0, 512, 77], [700, 129, 1], dtype=torch.bfloat16, device="cuda", seed=5,
                  kv_cache_dtype=kv)


@pytest.mark.parametrize("kv", KV)
def test_backend_quantized_model_shapes(kv):
    from kernel_checks import check_backend

    check_backend(32, 8, 128, 16, [0, 300, 1023], [257, 1, 1], dtype=torch.bfloat16, device="cuda", seed=7,
                  kv_cache_dtype=kv)


def _generate(kv: str, enforce_eager: bool):
    from rooflm import LLM, SamplingParams

    llm = LLM("smollm2-135m", load_format="dummy", dtype="bfloat16", kv_cache_dtype=kv, max_num_seqs=8,
              kv_cache_memory=256 * 2**20, max_model_len=512, enforce_eager=enforce_eager, show_progress=False)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (5, 77, 140, 33)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    runner = llm.engine.runner
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    return [o.outputs[0].token_ids for o in outs], (runner.graph_runner.replays if runner.graph_runner else 0), \
        llm.engine.kv.num_blocks


@pytest.mark.parametrize("kv", KV)
def test_engine_cuda_graphs_equal_eager(kv):
    eager, _, blocks = _generate(kv, True)
    graphs, replays, _ = _generate(kv, False)
    assert graphs == eager
    assert replays > 0, "the decode steps did not use the CUDA graphs"
    _, _, auto_blocks = _generate("auto", True)
    # one byte a value against bfloat16's two, plus a float32 scale per token and head: for head_dim 64 the pool
    # holds 128 / (64 + 4) = 1.88 times the blocks
    head_dim = 64
    assert blocks >= 0.99 * auto_blocks * (2 * head_dim) / (head_dim + 4)
