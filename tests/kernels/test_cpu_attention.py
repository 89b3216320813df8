"""The CPU attention backend against the reference backend, through the protocol a model calls."""
import pytest
import torch
from kernel_checks import check_backend

from rooflm.attention.cpu_backend import CpuAttention
from rooflm.layers.custom_op import OpSelection


CASES = [
    # (heads, kv_heads, head_dim, block_size, cached tokens, new tokens, window)
    (4, 4, 16, 4, [0], [9], None),  # one prompt, plain multi-head attention
    (6, 2, 16, 4, [0], [13], None),  # grouped-query prompt
    (6, 2, 16, 4, [10], [1], None),  # batch-1 decode
    (6, 2, 16, 4, [10, 3, 17], [1, 1, 1], None),  # batched decode, different lengths
    (6, 3, 16, 8, [5, 0], [7, 4], None),  # chunked prefill beside a new prompt
    (4, 2, 16, 4, [12, 2], [1, 1], 5),  # decode with a sliding window
    (4, 2, 16, 4, [9], [6], 4),  # prefill with a sliding window
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_cpu_backend_matches_reference(case, dtype):
    heads, kv_heads, head_dim, block, ctx, new, window = case
    check_backend(heads, kv_heads, head_dim, block, ctx, new, window, dtype=dtype, backend_cls=CpuAttention)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("case", [CASES[2], CASES[3], CASES[4], CASES[6]])
def test_cpu_backend_with_a_quantized_cache(case, kv_cache_dtype):
    heads, kv_heads, head_dim, block, ctx, new, window = case
    check_backend(heads, kv_heads, head_dim, block, ctx, new, window, dtype=torch.float32,
                  kv_cache_dtype=kv_cache_dtype, backend_cls=CpuAttention)


def test_auto_chooses_cpu_backend_on_cpu_only():
    assert OpSelection(torch.device("cpu")).attention_impl() == "cpu"
    assert OpSelection(torch.device("cpu")).impl() == "cpu"
    assert OpSelection(torch.device("cpu"), ops="native").attention_impl() == "torch"
    assert OpSelection(torch.device("meta")).impl() == "native"
