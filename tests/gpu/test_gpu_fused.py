"""The fused-prologue projections on CUDA at Llama-7B sizes: every GEMV candidate configuration, both dtypes, the
dispatcher's pick, and replay from a CUDA graph with fresh inputs."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from kernel_checks import assert_close, check_rmsnorm_gemv, check_silu_mul_gemv  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _candidates():
    from rooflm.kernels.gemv import CANDIDATES

    return CANDIDATES


@pytest.mark.parametrize("ci", range(9))
@pytest.mark.parametrize("with_residual", [True, False])
def test_rmsnorm_gemv_candidates(ci, with_residual):
    cfg = _candidates()[ci]
    for m in ([1] if not cfg.use_dot else [1, 2, 7, 16]):
        check_rmsnorm_gemv(cfg, m, 12288, 4096, with_residual, bias=ci % 2 == 1, device=DEV, seed=ci * 17 + m)


@pytest.mark.parametrize("ci", range(5))  # the one-row configurations
@pytest.mark.parametrize("with_residual", [True, False])
def test_rmsnorm_gemv_one_pass(ci, with_residual):
    cfg = _candidates()[ci]
    assert not cfg.use_dot and cfg.split_k == 1
    for n, k in ((12288, 4096), (22016, 4096), (1000, 2000)):
        check_rmsnorm_gemv(cfg, 1, n, k, with_residual, bias=n == 1000, device=DEV, seed=ci + n, one_pass=True)
    check_rmsnorm_gemv(cfg, 1, 4096, 4096, with_residual, dtype=torch.bfloat16, device=DEV, seed=ci, one_pass=True)


@pytest.mark.parametrize("ci", range(9))
def test_silu_mul_gemv_candidates(ci):
    cfg = _candidates()[ci]
    for m in ([1] if not cfg.use_dot else [1, 3, 16]):
        check_silu_mul_gemv(cfg, m, 4096, 11008, bias=ci % 2 == 0, device=DEV, seed=ci * 13 + m)


@pytest.mark.parametrize("ci", [0, 6])
def test_fused_gemv_bfloat16_uneven(ci):
    cfg = _candidates()[ci]
    m = 1 if not cfg.use_dot else 9
    check_rmsnorm_gemv(cfg, m, 1000, 2000, True, bias=True, dtype=torch.bfloat16, device=DEV, seed=ci)
    check_silu_mul_gemv(cfg, m, 1000, 1000, bias=True, dtype=torch.bfloat16, device=DEV, seed=ci)


@pytest.mark.parametrize("rows", [1, 4, 16])
def test_fused_layers_replay_from_a_cuda_graph(rows):
    """Picked eagerly (the dispatcher times outside captures), then captured: replaying the graph on new inputs gives
    what the eager op gives on them, and both agree with the reference path."""
    from test_kernel_fused_gemv import _layers

    from rooflm.layers.custom_op import select_ops

    dtype = torch.float16
    norm, proj, act, down, fused_norm, fused_act = _layers(DEV, dtype, True, "triton", hidden=4096, out=2 * 5504)
    x, r = torch.randn(rows, 4096, device=DEV, dtype=dtype), torch.randn(rows, 4096, device=DEV, dtype=dtype)
    gu = torch.randn(rows, 2 * 5504, device=DEV, dtype=dtype)

    def step():
        y, res = fused_norm(x, r)
        return y, res, fused_act(gu)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    x.copy_(torch.randn_like(x))
    r.copy_(torch.randn_like(r))
    gu.copy_(torch.randn_like(gu))
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for got, want in zip(outs, eager, strict=True):
        assert torch.equal(got, want)
    for m in (norm, proj, act, down, fused_norm, fused_act):
        select_ops(m, "native", DEV)
    h, res = norm(x, r)
    ref = (proj(h), res, down(act(gu)))
    assert torch.equal(outs[1], ref[1])
    assert_close(outs[0], ref[0], dtype, "norm + qkv from the graph", scale=ref[0].abs().max().item())
    assert_close(outs[2], ref[2], dtype, "silu + down from the graph", scale=ref[2].abs().max().item())
