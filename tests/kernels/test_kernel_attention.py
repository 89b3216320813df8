"""Paged decode / prefill attention kernels and the Triton backend against the torch reference (small shapes)."""
import pytest
import torch

from kernel_checks import check_backend, check_decode, check_prefill


# GQA ratios 1, 4 and 8; odd lengths; lengths on and around block boundaries; padded rows (seq_len 0).
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("lens,block_size", [([1, 15, 16, 17], 16), ([33, 7, 0], 8)])
def test_decode_gqa_and_lengths(device, num_heads, num_kv_heads, lens, block_size):
    check_decode(num_heads, num_kv_heads, 64, block_size, lens, device=device, seed=len(lens) + num_heads)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
@pytest.mark.parametrize("fused_reduce", [True, False])
def test_decode_split_counts(device, num_splits, fused_reduce):
    # more splits than tiles leaves empty splits; their partials must not disturb the sum. fused_reduce: the last
    # split program combines (one launch); otherwise a second kernel does.
    check_decode(4, 2, 32, 16, [100, 3, 48], num_splits=num_splits, device=device, seed=num_splits,
                 fused_reduce=fused_reduce)


@pytest.mark.parametrize("window", [1, 7, 16, 64])
def test_decode_sliding_window(device, window):
    check_decode(4, 1, 32, 8, [5, 40, 57], window=window, num_splits=3, device=device, seed=window)


def test_decode_head_dim_not_power_of_two(device):
    check_decode(6, 2, 80, 16, [19, 50], device=device)


def test_decode_bfloat16(device):
    check_decode(8, 2, 64, 16, [31, 65], dtype=torch.bfloat16, device=device)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("ctx_lens,q_lens", [([0, 0], [17, 1]), ([16, 5, 0], [16, 11, 3]), ([31], [2])])
def test_prefill_gqa_and_prefix(device, num_heads, num_kv_heads, ctx_lens, q_lens):
    check_prefill(num_heads, num_kv_heads, 32, 16, ctx_lens, q_lens, device=device, seed=sum(q_lens))


@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_prefill_sliding_window(device, window):
    check_prefill(4, 2, 32, 8, [0, 21], [37, 12], window=window, device=device, seed=window)


def test_prefill_head_dim_not_power_of_two(device):
    check_prefill(4, 2, 48, 16, [3], [29], device=device)


def test_prefill_bfloat16(device):
    check_prefill(4, 1, 64, 16, [9, 0], [20, 13], dtype=torch.bfloat16, device=device)


@pytest.mark.parametrize("ctx_lens,q_lens", [([5, 16, 31], [1, 1, 1]), ([0, 40], [19, 1]), ([12], [20])])
@pytest.mark.parametrize("window", [None, 9])
def test_backend_matches_reference(device, ctx_lens, q_lens, window):
    check_backend(8, 2, 32, 16, ctx_lens, q_lens, window=window, device=device, seed=sum(ctx_lens))


def test_backend_via_get_attention_backend():
    from rooflm.attention.backend import get_attention_backend

    assert get_attention_backend("triton").name == "triton"
