"""Token-level KV (``block_size=1``, LightLLM's layout): every attention path reads a context whose every token lives
in its own block, scattered over the pool. Each path is compared with the torch reference."""
import pytest
import torch
from kernel_checks import check_backend, check_decode, check_prefill

from rooflm.attention.cpu_backend import CpuAttention


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2)])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_kernel_token_blocks(device, num_heads, num_kv_heads, num_splits):
    check_decode(num_heads, num_kv_heads, 32, 1, [1, 17, 40, 0], num_splits=num_splits, device=device,
                 seed=num_heads + (num_splits or 0))


def test_decode_kernel_token_blocks_window(device):
    check_decode(4, 1, 32, 1, [5, 33], window=7, num_splits=2, device=device, seed=3)


@pytest.mark.parametrize("ctx_lens,q_lens", [([0, 0], [17, 1]), ([16, 5, 0], [16, 11, 3]), ([31], [2])])
def test_prefill_kernel_token_blocks(device, ctx_lens, q_lens):
    check_prefill(8, 2, 32, 1, ctx_lens, q_lens, device=device, seed=sum(q_lens))


@pytest.mark.parametrize("ctx_lens,q_lens", [([5, 16, 31], [1, 1, 1]), ([0, 40], [19, 1]), ([12], [20])])
def test_triton_backend_token_blocks(device, ctx_lens, q_lens):
    check_backend(8, 2, 32, 1, ctx_lens, q_lens, device=device, seed=sum(ctx_lens))


@pytest.mark.parametrize("ctx_lens,q_lens,window", [([0], [13], None), ([10, 3, 17], [1, 1, 1], None),
                                                    ([5, 0], [7, 4], None), ([12, 2], [1, 1], 5)])
def test_cpu_backend_token_blocks(ctx_lens, q_lens, window):
    check_backend(6, 2, 16, 1, ctx_lens, q_lens, window, dtype=torch.float32, backend_cls=CpuAttention)
