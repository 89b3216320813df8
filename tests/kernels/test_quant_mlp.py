"""The fused packed MLP of one decode row (rooflm/kernels/quant_mlp.py) against its float64 twin and against the
word GEMVs it replaces: its activations bit-equal to gate_up's word GEMV with SiLU-and-mul on the same tile, its
output within rounding of the twin, its handoff epilogue within one rounding of the unfused pair's. On the CPU it runs
under Triton's interpreter (the float32 form); on CUDA the same tests run the float16x2 form."""
from __future__ import annotations

import pytest
import torch

from test_quant_gemm import LIMIT, make_packed


def _weights(device, bits, group, mins, hidden=256, inter=384, seed=0):
    gs_gu = hidden if group == "channel" else group
    gs_dn = inter if group == "channel" else group
    gu = make_packed(2 * inter, hidden, bits, gs_gu, mins, False, torch.float16, device, seed=seed)
    dn = make_packed(hidden, inter, bits, gs_dn, mins, False, torch.float16, device, seed=seed + 1)
    return gu, dn


def _configs():
    from rooflm.kernels.quant_mlp import FusedMlpConfig

    return [FusedMlpConfig(16, 8, 32, 2, 1), FusedMlpConfig(32, 16, 64, 4, 0),
            FusedMlpConfig(64, 32, 128, 4, 1, pair=True, reduce_block=16), FusedMlpConfig(128, 64, 256, 8, 1)]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("bits,group,mins", [(4, 64, True), (4, 128, True), (4, 128, False), (8, "channel", False),
                                             (8, 128, True)])
def test_fused_mlp_against_twin(device, bits, group, mins):
    """Every configuration that fits, against the float64 twin (act rounded to float16 as the unfused pair rounds
    it); the down bias on every other one; the result is the same bits on a second run."""
    from rooflm.kernels.quant_mlp import fits, fused_mlp, fused_mlp_ref

    gu, dn = _weights(device, bits, group, mins, seed=bits)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, gu.in_features, generator=g).half().to(device)
    ran = 0
    for i, cfg in enumerate(_configs()):
        if not fits(gu, dn, cfg):
            continue
        bias = torch.randn(dn.out_features, generator=g).half().to(device) if i % 2 else None
        out = fused_mlp(x, gu, dn, cfg, down_bias=bias)
        ref = fused_mlp_ref(x, gu, dn, bias)
        assert out.shape == (1, dn.out_features) and out.dtype == x.dtype
        assert _rel(out, ref) < LIMIT[torch.float16], f"{cfg}: relative error {_rel(out, ref):.2e}"
        assert torch.equal(out, fused_mlp(x, gu, dn, cfg, down_bias=bias)), f"{cfg}: not deterministic"
        ran += 1
    assert ran >= 3, "most configurations must fit these weights"


@pytest.mark.parametrize("bits", [4, 8])
def test_activations_equal_word_gemv_silu_mul(device, bits):
    """Phase 1 is the word GEMV's SiLU-and-mul tile with the handoff consumer's 1/rms: the activations it stores are
    bit-equal to ``packed_rmsnorm_sumsq_gemv(..., silu_mul=True)`` on the same tile, prefetching or not."""
    from rooflm.kernels.handoff_gemv import packed_rmsnorm_sumsq_gemv
    from rooflm.kernels.quant_gemv import QuantGemvConfig
    from rooflm.kernels.quant_mlp import fits, fused_mlp

    gu, dn = _weights(device, bits, 128 if bits == 4 else "channel", bits == 4)
    g = torch.Generator().manual_seed(2)
    y = torch.randn(1, gu.in_features, generator=g).half().to(device)
    ss = (torch.rand(7, generator=g) * 40).float().to(device)
    for cfg in _configs():
        if not fits(gu, dn, cfg):
            continue
        act = torch.empty(1, dn.in_features, dtype=torch.float16, device=device)
        fused_mlp(y, gu, dn, cfg, rstd_sumsq=ss, eps=1e-5, act=act)
        word = QuantGemvConfig(2 * cfg.block_i, cfg.words, 1, cfg.num_warps, prefetch=cfg.prefetch, pair=cfg.pair)
        want = packed_rmsnorm_sumsq_gemv(y, ss, 1e-5, gu, None, word, silu_mul=True)
        assert torch.equal(act, want), f"{cfg}: activations differ from the word GEMV's"


def test_handoff_epilogue_matches_the_unfused_pair(device):
    """With the handoff at both ends (x from the producer before it, the next norm's add and statistic after it)
    the residual stream, the scaled row and the partial sums of squares match the pair of word GEMVs within one
    rounding (the down sums are added in another order)."""
    from rooflm.kernels.handoff_gemv import packed_add_sumsq, packed_rmsnorm_sumsq_gemv
    from rooflm.kernels.quant_gemv import QuantGemvConfig
    from rooflm.kernels.quant_mlp import FusedMlpConfig, fused_mlp

    gu, dn = _weights(device, 4, 128, True)
    hidden = gu.in_features
    g = torch.Generator().manual_seed(3)
    y = torch.randn(1, hidden, generator=g).half().to(device)
    ss = (torch.rand(5, generator=g) * 50).float().to(device)
    res = torch.randn(1, hidden, generator=g).half().to(device)
    nw = (1 + 0.1 * torch.randn(hidden, generator=g)).half().to(device)
    cfg = FusedMlpConfig(32, 16, 64, 4, 1, reduce_block=16)
    h = torch.empty_like(res)
    sumsq = torch.empty(hidden // cfg.reduce_block, dtype=torch.float32, device=device)
    out = fused_mlp(y, gu, dn, cfg, rstd_sumsq=ss, eps=1e-5, add_sumsq=(res, nw, h, sumsq))
    act = packed_rmsnorm_sumsq_gemv(y, ss, 1e-5, gu, None, QuantGemvConfig(64, 16, 1, 4, prefetch=1), True)
    y2, h2, ss2 = packed_add_sumsq(act, dn, None, QuantGemvConfig(16, 16, 1, 4), res, nw)
    assert _rel(h, h2) < 1e-3 and _rel(out, y2) < 1e-3
    assert abs(sumsq.sum().item() - ss2.sum().item()) <= 1e-3 * ss2.sum().item()
    assert (h - h2).abs().max().item() <= 2 * torch.finfo(torch.float16).eps * h2.abs().max().item()


def test_bad_inputs_name_the_field(device):
    from rooflm.kernels.quant_mlp import FusedMlpConfig, fits, fused_mlp

    with pytest.raises(ValueError, match="block_i=24"):
        FusedMlpConfig(24, 16, 64)
    with pytest.raises(ValueError, match="prefetch=2"):
        FusedMlpConfig(32, 16, 64, prefetch=2)
    gu, dn = _weights(device, 4, 64, True)
    x = torch.randn(1, gu.in_features).half().to(device)
    big = FusedMlpConfig(128, 16, 64)  # 128 intermediate columns a program straddle down's groups of 64
    assert not fits(gu, dn, big)
    with pytest.raises(ValueError, match="does not fit"):
        fused_mlp(x, gu, dn, big)
    with pytest.raises(ValueError, match=r"x must be one contiguous row \[1, 256\]"):
        fused_mlp(torch.randn(2, gu.in_features).half().to(device), gu, dn, FusedMlpConfig(32, 16, 64))
    _, other = _weights(device, 8, "channel", False)
    assert not fits(gu, other, FusedMlpConfig(32, 16, 64))  # two widths


def test_mode_setting(monkeypatch):
    from rooflm.kernels.quant_mlp import DEFAULT_MODE, quant_mlp_mode

    monkeypatch.delenv("ROOFLM_QUANT_MLP", raising=False)
    assert quant_mlp_mode() == DEFAULT_MODE
    monkeypatch.setenv("ROOFLM_QUANT_MLP", "auto")
    assert quant_mlp_mode() == "auto"
    monkeypatch.setenv("ROOFLM_QUANT_MLP", "yes")
    with pytest.raises(ValueError, match="ROOFLM_QUANT_MLP='yes'"):
        quant_mlp_mode()
