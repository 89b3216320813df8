"""K/V cache write (+ rotary), fused add + RMSNorm, SiLU-and-mul and GEMV / flat GEMM against their twins."""
import pytest
import torch

from kernel_checks import (check_gemv, check_rmsnorm, check_rotary, check_silu_and_mul, check_write_kv,
                           gemv_test_configs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,num_kv_heads,head_dim", [(7, 2, 32), (20, 3, 80)])
def test_write_kv_cache(device, dtype, num_tokens, num_kv_heads, head_dim):
    check_write_kv(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim,rot_dim", [(64, 64), (64, 32)])
@pytest.mark.parametrize("write", [True, False])
def test_rotary_write_kv_cache(device, is_neox, head_dim, rot_dim, write):
    check_rotary(9, 4, 2, head_dim, rot_dim, is_neox, write, device=device, seed=rot_dim)


def test_rotary_per_token_cos_sin(device):
    check_rotary(9, 4, 2, 64, 64, True, True, device=device, per_token=True)


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("hidden", [64, 200])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rmsnorm(device, with_residual, hidden, dtype):
    check_rmsnorm(5, hidden, with_residual, dtype=dtype, device=device)


@pytest.mark.parametrize("d", [64, 1500])
def test_silu_and_mul(device, d):
    check_silu_and_mul(3, d, device=device)


@pytest.mark.parametrize("ci", range(4))
@pytest.mark.parametrize("n,k", [(64, 256), (50, 200)])  # even and uneven tiles
@pytest.mark.parametrize("bias", [False, True])
def test_gemv(device, ci, n, k, bias):
    cfg = gemv_test_configs()[ci]
    for m in ([1] if not cfg.use_dot else [1, 3, 16]):
        check_gemv(cfg, m, n, k, bias, device=device, seed=m + n)


@pytest.mark.parametrize("ci", [0, 3])
def test_gemv_bfloat16(device, ci):
    cfg = gemv_test_configs()[ci]
    check_gemv(cfg, 1 if not cfg.use_dot else 5, 48, 160, True, dtype=torch.bfloat16, device=device)


def test_gemv_rejects_too_many_rows(device):
    from rooflm.kernels.gemv import GemvConfig, gemv

    with pytest.raises(ValueError):
        gemv(torch.randn(17, 32, device=device, dtype=torch.float16),
             torch.randn(16, 32, device=device, dtype=torch.float16), None, GemvConfig(True, 16, 32))


def test_linear_dispatch_falls_back_off_cuda():
    from rooflm.kernels.gemv import linear

    x, w, b = torch.randn(2, 8), torch.randn(4, 8), torch.randn(4)
    torch.testing.assert_close(linear(x, w, b), torch.nn.functional.linear(x, w, b))


def test_rotary_and_decode_attention_take_cos_sin_as_views_of_one_table(device):
    """The model looks cos / sin up in one [positions, cos | sin] table on the GPU (``RotaryEmbedding``): its rows
    reach the rotary kernel and decode attention as two views with one row stride, and give the same bits as two
    separate tensors of the same values; two different row strides are refused by name."""
    from kernel_checks import new_token_step

    from rooflm.kernels.decode_attention import NewTokenKV, paged_decode_attention
    from rooflm.kernels.kv_cache import rotary_write_kv_cache

    q, k, v, cos, sin, cache, tables, seq_lens, slots = new_token_step(4, 2, 64, 16, [5, 19], torch.float16,
                                                                        device, seed=3)
    table = torch.cat([cos, sin], dim=1)  # [2, 64]: what RotaryEmbedding.cos_sin gathers
    tcos, tsin = table[:, :32], table[:, 32:]
    assert tcos.stride(0) == 64 and not tcos.is_contiguous()
    outs = []
    for c, s in ((cos, sin), (tcos, tsin)):
        out = paged_decode_attention(q.clone(), cache.clone(), tables, seq_lens, 0.125,
                                     new_kv=NewTokenKV(k.clone(), v.clone(), c, s, slots))
        qr, kr = rotary_write_kv_cache(q.clone(), k.clone(), v, None, c, s, None, slots, True)
        outs.append((out, qr, kr))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="row strides differ: 64 / 32"):
        rotary_write_kv_cache(q.clone(), k.clone(), v, None, tcos, sin, None, slots, True)
    with pytest.raises(ValueError, match="new_kv.cos/sin row strides differ: 64 / 32"):
        paged_decode_attention(q.clone(), cache.clone(), tables, seq_lens, 0.125,
                               new_kv=NewTokenKV(k.clone(), v.clone(), tcos, sin, slots))
