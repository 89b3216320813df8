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


@pytest.mark.parametrize("cfg_args", [(False, 16, 64), (False, 4, 64), (True, 16, 64), (True, 32, 32)])
@pytest.mark.parametrize("d,k", [(64, 256), (50, 200)])  # even and uneven tiles
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_silu_mul_epilogue_equals_the_gemv_then_the_activation_kernel(device, cfg_args, d, k, dtype):
    """The epilogue pairs gate row n with up row n in one program; each row's sum is the plain GEMV's, so the result
    must equal the GEMV followed by the activation kernel bit for bit (and the float64 reference closely)."""
    from rooflm.kernels.activation import silu_and_mul, silu_and_mul_ref
    from rooflm.kernels.fused_gemv import gemv_silu_mul, rmsnorm_gemv
    from rooflm.kernels.gemv import GemvConfig, gemv

    cfg = GemvConfig(*cfg_args)
    g = torch.Generator().manual_seed(d + k)
    for m in ([1] if not cfg.use_dot else [1, 3, 16]):
        for bias in (False, True):
            x = torch.randn(m, k, generator=g).to(dtype).to(device)
            w = (2 * torch.randn(2 * d, k, generator=g) / k**0.5).to(dtype).to(device)
            b = torch.randn(2 * d, generator=g).to(dtype).to(device) if bias else None
            got = gemv_silu_mul(x, w, b, cfg)
            assert got.shape == (m, d)
            want = silu_and_mul(gemv(x, w, b, cfg))
            if device == "cpu" and cfg.use_dot:
                # the interpreter's tl.dot is numpy's matmul, whose float32 summation order may follow the operand
                # tiles' memory layout (the BLAS kernel the CPU gets): at most one rounding of the dtype apart there;
                # the compiled kernels are checked bit for bit on CUDA
                torch.testing.assert_close(got, want, atol=1e-7, rtol=torch.finfo(dtype).eps, msg=str((cfg, m, bias)))
            else:
                assert torch.equal(got, want), (cfg, m, bias)
            ref = silu_and_mul_ref(torch.nn.functional.linear(x.double(), w.double(), None if b is None
                                                              else b.double()).to(dtype))
            torch.testing.assert_close(got, ref, atol=0.05, rtol=0.05)
    if not cfg.use_dot:  # with the one-pass norm prologue too (one row): the fused norm GEMV, then the activation
        x, r = (torch.randn(1, k, generator=g).to(dtype).to(device) for _ in range(2))
        nw = (1 + 0.2 * torch.randn(k, generator=g)).to(dtype).to(device)
        w = (torch.randn(2 * d, k, generator=g) / k**0.5).to(dtype).to(device)
        for one_pass in (True, False):
            got, res = rmsnorm_gemv(x, nw, 1e-5, w, None, cfg, r, one_pass=one_pass, silu_mul=True)
            plain, plain_res = rmsnorm_gemv(x, nw, 1e-5, w, None, cfg, r, one_pass=one_pass)
            assert torch.equal(got, silu_and_mul(plain)) and torch.equal(res, plain_res)


def test_silu_mul_epilogue_refuses_what_it_cannot_pair(device):
    from rooflm.kernels.fused_gemv import gemv_silu_mul
    from rooflm.kernels.gemv import GemvConfig

    x = torch.randn(1, 32, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="even"):
        gemv_silu_mul(x, torch.randn(15, 32, dtype=torch.float16, device=device), None, GemvConfig(False, 16, 32))
    with pytest.raises(ValueError, match="one K split"):
        gemv_silu_mul(x, torch.randn(16, 32, dtype=torch.float16, device=device), None, GemvConfig(False, 16, 32, 2))


def test_norm_to_activation_in_one_gemv_matches_the_parts(device):
    """RMSNormLinear.norm_gemv_silu_mul (one row: add + norm + [gate | up] projection + SiLU-and-mul in one launch)
    against the reference modules in turn; it declines what it does not take, so the caller runs the parts."""
    from rooflm.kernels.activation import silu_and_mul_ref
    from rooflm.layers.custom_op import select_ops

    norm, proj, _, _, fused_norm, _ = _layers(device, torch.float16, False, "triton")
    g = torch.Generator().manual_seed(11)
    x, r = (torch.randn(1, 64, generator=g).half().to(device) for _ in range(2))
    act, res = fused_norm.norm_gemv_silu_mul(x, r)
    assert fused_norm.norm_gemv_silu_mul(x.repeat(5, 1), r.repeat(5, 1)) is None  # one row only
    assert fused_norm.norm_gemv_silu_mul(x, None) is None
    for m in (norm, proj, fused_norm):
        select_ops(m, "native", device)
    h, want_res = norm(x, r)
    assert torch.equal(res, want_res) and act.shape == (1, 24)
    # one-pass norm: about one rounding of the dtype from the unfused norm (see fused_gemv.py), then the activation
    torch.testing.assert_close(act, silu_and_mul_ref(proj(h)), atol=1e-2, rtol=1e-2)
    assert fused_norm.norm_gemv_silu_mul(x, r) is None  # the reference path never fuses


@pytest.mark.parametrize("seqs", [1, 3])
def test_a_decode_step_runs_the_mlp_activation_inside_the_gate_up_gemv(device, seqs, monkeypatch):
    """A tiny float16 Llama on the Triton path: at one row every layer runs norm -> gate_up -> SiLU-and-mul as one
    GEMV, at three rows the activation rides in gate_up's GEMV; the logits match the reference selection."""
    import rooflm.kernels.fused_gemv as fg
    from kernel_checks import tiny_llama
    from rooflm.attention.metadata_utils import allocate_kv_caches, build_attention_metadata
    from rooflm.layers.custom_op import select_ops

    model = tiny_llama(device, layers=2, seed=4)
    calls = {"norm_act": 0, "act": 0}

    def spy(name, fn):
        def wrapped(*a, **k):
            if name == "act" or k.get("silu_mul"):
                calls[name] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setenv("ROOFLM_FUSED_GEMV", "on")  # on a GPU: fused whatever the timing of these tiny shapes
    monkeypatch.setattr(fg, "_choices", {})
    # the handoff between projections (test_kernel_handoff_gemv.py) would take the one-row step's norms first
    monkeypatch.setattr("rooflm.kernels.handoff_gemv.pick_handoff", lambda *a: None)
    monkeypatch.setattr(fg, "rmsnorm_gemv", spy("norm_act", fg.rmsnorm_gemv))
    monkeypatch.setattr(fg, "gemv_silu_mul", spy("act", fg.gemv_silu_mul))
    caches = allocate_kv_caches(2, 8, 4, 2, 16, torch.float16, device)  # block size 4: 4 tokens per sequence
    tables = [[i] for i in range(seqs)]
    g = torch.Generator().manual_seed(seqs)
    logits = []
    for m in (None, "native"):
        if m:
            select_ops(model, m, device)
        done = [0] * seqs
        for step, new in enumerate(([2] * seqs, [1] * seqs, [1] * seqs)):  # a short prefill, two decode steps
            if step == 2 and m is None:
                calls.update(norm_act=0, act=0)  # count the Triton path's second decode step only (on a GPU the
                # first one times its candidates through the same functions)
            meta, pos = build_attention_metadata(tables, done, new, 4, device)
            ids = torch.randint(0, 96, (sum(new),), generator=g).to(device)
            with torch.no_grad():
                out = model.compute_logits(model(ids, pos, caches, meta))
            done = [d + n for d, n in zip(done, new)]
        logits.append(out)
        g = torch.Generator().manual_seed(seqs)
        if m is None:
            decode_calls = dict(calls)
    assert decode_calls == ({"norm_act": 2, "act": 0} if seqs == 1 else {"norm_act": 0, "act": 2})
    torch.testing.assert_close(logits[0], logits[1], atol=2e-2, rtol=2e-2)
