"""Projections with their elementwise prologue in the GEMV (add + RMSNorm before qkv / gate_up, SiLU-and-mul before
down) against their unfused twins, and the layers that use them against their reference path."""
import pytest
import torch

from kernel_checks import check_rmsnorm_gemv, check_silu_mul_gemv, gemv_test_configs


@pytest.mark.parametrize("ci", range(4))
@pytest.mark.parametrize("n,k", [(64, 256), (50, 200)])  # even and uneven tiles
@pytest.mark.parametrize("with_residual", [True, False])
def test_rmsnorm_gemv(device, ci, n, k, with_residual):
    cfg = gemv_test_configs()[ci]
    for m in ([1] if not cfg.use_dot else [1, 3, 16]):
        check_rmsnorm_gemv(cfg, m, n, k, with_residual, bias=ci == 2, device=device, seed=m + n + ci)


@pytest.mark.parametrize("n,k", [(64, 256), (50, 200)])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_rmsnorm_gemv_one_pass(device, n, k, with_residual, bias):
    from rooflm.kernels.gemv import GemvConfig

    check_rmsnorm_gemv(GemvConfig(False, 16, 64), 1, n, k, with_residual, bias=bias, device=device, seed=n + k,
                       one_pass=True)
    check_rmsnorm_gemv(GemvConfig(False, 16, 64), 1, n, k, with_residual, bias=bias, dtype=torch.bfloat16,
                       device=device, seed=n, one_pass=True)


@pytest.mark.parametrize("ci", [0, 3])
def test_rmsnorm_gemv_bfloat16(device, ci):
    cfg = gemv_test_configs()[ci]
    check_rmsnorm_gemv(cfg, 1 if not cfg.use_dot else 5, 48, 160, True, bias=True, dtype=torch.bfloat16,
                       device=device)


@pytest.mark.parametrize("ci", range(4))
@pytest.mark.parametrize("n,d", [(64, 256), (50, 200)])
def test_silu_mul_gemv(device, ci, n, d):
    cfg = gemv_test_configs()[ci]
    for m in ([1] if not cfg.use_dot else [1, 4, 16]):
        check_silu_mul_gemv(cfg, m, n, d, bias=ci == 3, device=device, seed=m + d + ci)


def test_silu_mul_gemv_bfloat16(device):
    check_silu_mul_gemv(gemv_test_configs()[3], 6, 40, 96, bias=False, dtype=torch.bfloat16, device=device)


def test_fused_gemv_rejects_bad_shapes(device):
    from rooflm.kernels.fused_gemv import rmsnorm_gemv, silu_mul_gemv
    from rooflm.kernels.gemv import GemvConfig

    h = dict(dtype=torch.float16, device=device)
    cfg = GemvConfig(True, 16, 32)
    w = torch.randn(16, 32, **h)
    with pytest.raises(ValueError, match="rows"):
        rmsnorm_gemv(torch.randn(17, 32, **h), torch.ones(32, **h), 1e-6, w, None, cfg)
    with pytest.raises(ValueError, match="norm_weight"):
        rmsnorm_gemv(torch.randn(2, 32, **h), torch.ones(31, **h), 1e-6, w, None, cfg)
    with pytest.raises(ValueError, match="residual"):
        rmsnorm_gemv(torch.randn(2, 32, **h), torch.ones(32, **h), 1e-6, w, None, cfg, torch.randn(3, 32, **h))
    with pytest.raises(ValueError, match="weight"):
        rmsnorm_gemv(torch.randn(2, 32, **h), torch.ones(32, **h), 1e-6, torch.randn(16, 33, **h), None, cfg)
    with pytest.raises(ValueError, match="one_pass"):
        rmsnorm_gemv(torch.randn(2, 32, **h), torch.ones(32, **h), 1e-6, w, None, cfg, one_pass=True)
    with pytest.raises(ValueError, match="one_pass"):
        rmsnorm_gemv(torch.randn(1, 32, **h), torch.ones(32, **h), 1e-6, w, None, GemvConfig(False, 16, 32, 2),
                     one_pass=True)
    with pytest.raises(ValueError, match="even"):
        silu_mul_gemv(torch.randn(2, 33, **h), w, None, cfg)
    with pytest.raises(ValueError, match="weight"):
        silu_mul_gemv(torch.randn(2, 48, **h), w, None, cfg)  # d = 24 but weight has K = 32
    with pytest.raises(ValueError, match="M=2"):
        silu_mul_gemv(torch.randn(2, 64, **h), w, None, GemvConfig(False, 16, 32))


def test_fused_gemv_mode_is_validated(monkeypatch):
    from rooflm.kernels.fused_gemv import fused_gemv_mode

    monkeypatch.setenv("ROOFLM_FUSED_GEMV", "maybe")
    with pytest.raises(ValueError, match="ROOFLM_FUSED_GEMV"):
        fused_gemv_mode()


def _layers(device, dtype, bias, ops, hidden=64, out=48):
    from rooflm.layers.activation import SiluAndMul, SiluAndMulLinear
    from rooflm.layers.custom_op import op_selection
    from rooflm.layers.linear import Linear
    from rooflm.layers.norm import RMSNorm, RMSNormLinear

    g = torch.Generator().manual_seed(3)
    with op_selection(device, ops=ops):
        norm, proj = RMSNorm(hidden, 1e-5), Linear(hidden, out, bias=bias)
        act, down = SiluAndMul(), Linear(out // 2, hidden, bias=bias)
        fused_norm, fused_act = RMSNormLinear(norm, proj), SiluAndMulLinear(act, down)
    for p in (norm.weight, proj.weight, down.weight) + ((proj.bias, down.bias) if bias else ()):
        p.data = (torch.randn(p.shape, generator=g) / 4 + (1 if p is norm.weight else 0)).to(dtype).to(device)
    return norm, proj, act, down, fused_norm, fused_act


@pytest.mark.parametrize("rows", [1, 5, 20])  # 20 rows: above the GEMV limit, the unfused pair
@pytest.mark.parametrize("bias", [False, True])
def test_fused_layers_match_the_reference_path(device, rows, bias):
    from rooflm.layers.custom_op import select_ops

    dtype = torch.float16
    norm, proj, act, down, fused_norm, fused_act = _layers(device, dtype, bias, "triton")
    assert fused_norm.fuse and fused_act.fuse
    x = torch.randn(rows, 64).to(dtype).to(device)
    r = torch.randn(rows, 64).to(dtype).to(device)
    gu = (2 * torch.randn(rows, 48)).to(dtype).to(device)
    fast = [*fused_norm(x, r), *fused_norm(x), fused_act(gu)]
    for m in (norm, proj, act, down, fused_norm, fused_act):
        select_ops(m, "native", device)
    # the reference path is exactly the two modules in turn
    h, res = norm(x, r)
    ref = [proj(h), res, proj(norm(x)), x, down(act(gu))]
    for got, want in zip([*fused_norm(x, r), *fused_norm(x), fused_act(gu)], ref, strict=True):
        assert torch.equal(got, want)
    scale = max(t.abs().max().item() for t in ref)
    for i, (got, want) in enumerate(zip(fast, ref, strict=True)):
        assert got.shape == want.shape
        if i in (1, 3):
            assert torch.equal(got, want), "the residual stream must be exactly x + residual"
        else:
            from kernel_checks import assert_close

            assert_close(got, want, dtype, f"fused layer output {i}", scale=scale)


def test_fused_layers_register_no_parameters_and_obey_the_env_switch(device, monkeypatch):
    _, _, _, _, fused_norm, fused_act = _layers(device, torch.float16, True, "triton")
    assert list(fused_norm.parameters()) == [] and list(fused_act.parameters()) == []
    assert fused_norm.state_dict() == {} and fused_act.state_dict() == {}
    monkeypatch.setenv("ROOFLM_FUSED_GEMV", "off")
    _, _, _, _, fused_norm, fused_act = _layers(device, torch.float16, True, "triton")
    assert fused_norm.impl == "triton" and not fused_norm.fuse and not fused_act.fuse
    _, _, _, _, fused_norm, _ = _layers(device, torch.float16, True, "native")
    assert fused_norm.impl == "native" and not fused_norm.fuse


def test_fused_layers_reject_mismatched_parts():
    from rooflm.layers.activation import SiluAndMulLinear
    from rooflm.layers.linear import Linear
    from rooflm.layers.norm import RMSNorm, RMSNormLinear

    with pytest.raises(ValueError, match="in_features"):
        RMSNormLinear(RMSNorm(32), Linear(16, 8))
    with pytest.raises(ValueError, match="act"):
        SiluAndMulLinear(RMSNorm(32), Linear(16, 8))
