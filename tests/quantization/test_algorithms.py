"""GPTQ and AWQ against round-to-nearest on single layers whose inputs make the difference measurable."""
import pytest
import torch

from rooflm.quantization.awq import activation_scales, awq_quantize, clip_groups, search_clip, search_scales
from rooflm.quantization.gptq import HessianAccumulator, gptq_quantize
from rooflm.quantization.zeropoint import fake_quantize, group_params, quantize_int, search_group_params


def _output_error(x, w, w_hat):
    return ((x @ w_hat.t() - x @ w.t()) ** 2).mean().item()


def _correlated_inputs(m, k, seed):
    """Inputs with strongly correlated features and a few large-magnitude channels (what LLM activations look
    like: GPTQ's error feedback can move rounding error onto directions the inputs rarely take)."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.eye(k) + 0.5 * torch.randn(k, k, generator=gen) / k ** 0.5
    x = torch.randn(m, k, generator=gen) @ mix
    x[:, :4] *= 8
    return x


def test_hessian_accumulates_two_x_transpose_x_over_n():
    x = torch.randn(100, 12)
    acc = HessianAccumulator(12)
    for chunk in x.split(33):
        acc.add(chunk)
    assert torch.allclose(acc.hessian(), (2 * x.t() @ x / 100).float(), atol=1e-5)
    with pytest.raises(ValueError, match="no calibration inputs"):
        HessianAccumulator(3).hessian()


@pytest.mark.parametrize("bits,desc_act,search", [(4, False, False), (4, True, False), (8, False, False),
                                                  (4, True, True), (8, False, True)])
def test_gptq_beats_rtn_on_correlated_inputs(bits, desc_act, search):
    k, n, g = 128, 64, 32
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    x = _correlated_inputs(2048, k, seed=2)
    x_cal, x_test = x[:1024], x[1024:]  # the test rows were not in the Hessian
    acc = HessianAccumulator(k)
    acc.add(x_cal)
    q = gptq_quantize(w, acc.hessian(), bits, g, desc_act=desc_act, search_grid=search)
    rtn = quantize_int(w, bits, g, search=search)
    gptq_err = _output_error(x_test, w, q.dequantize())
    rtn_err = _output_error(x_test, w, rtn.dequantize())
    assert gptq_err < rtn_err
    assert q.codes.min() >= 0 and q.codes.max() < 2 ** bits
    if desc_act:
        assert q.g_idx is not None and torch.bincount(q.g_idx).tolist() == [g] * (k // g)
        assert not torch.equal(q.g_idx, torch.arange(k) // g)  # the large channels come first
        assert set(q.g_idx[:4].tolist()) == {0}


def test_gptq_groups_spanning_blocks_match_one_block():
    """Lazy batch updates (Frantar et al. 2023, section 3) change the order of the arithmetic, not the result; a
    group wider than a block takes its grid from the pending columns of the next blocks."""
    k = 64
    w = torch.randn(16, k, generator=torch.Generator().manual_seed(3))
    acc = HessianAccumulator(k)
    acc.add(_correlated_inputs(512, k, seed=4))
    one = gptq_quantize(w, acc.hessian(), 4, 64, blocksize=64)
    many = gptq_quantize(w, acc.hessian(), 4, 64, blocksize=16)
    assert torch.allclose(many.scales, one.scales, rtol=1e-3)
    assert (many.codes != one.codes).float().mean().item() < 0.01


@pytest.mark.parametrize("search", [False, True])
def test_gptq_on_uncorrelated_inputs_reduces_to_rtn(search):
    """With H a multiple of the identity, the error feedback is zero: GPTQ is round-to-nearest (on the same grid)."""
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(5))
    q = gptq_quantize(w, torch.eye(64), 4, 32, search_grid=search)
    rtn = quantize_int(w, 4, 32, search=search)
    assert torch.equal(q.codes, rtn.codes) and torch.equal(q.scales, rtn.scales) and torch.equal(q.zeros, rtn.zeros)


@pytest.mark.parametrize("min_zero", [0, 1])
def test_grid_search_never_loses_and_fixes_an_offset_grid(min_zero):
    """Groups already on a 4-bit grid whose minimum is not a whole number of steps from 0 (what a GGUF Q4_1 block
    dequantizes to): the min/max grid with an integer zero point is off by a fraction of a step for the whole
    group; the searched grid is never worse on any group and better on most of these."""
    gen = torch.Generator().manual_seed(12)
    d = torch.rand(64, 1, generator=gen) * 0.02 + 0.01
    codes = torch.randint(0, 16, (64, 32), generator=gen).float()
    codes[:, 0], codes[:, 1] = 0, 15  # both ends of the block's grid are used, as Q4_1 quantizes to them
    offset = -(torch.rand(64, 1, generator=gen) * 10 + 2.2)  # the block minimum, in steps (not whole)
    w = d * (codes + offset)
    rand = torch.randn(64, 32, generator=gen)
    for groups in (w, rand):
        s0, z0 = group_params(groups, 4, min_zero)
        s1, z1 = search_group_params(groups, 4, min_zero)
        e0 = (fake_quantize(groups, 4, 32, min_zero) - groups).square().sum(-1)
        q1 = (torch.round(groups / s1[:, None]) + z1[:, None]).clamp(0, 15)
        e1 = ((q1 - z1[:, None]) * s1[:, None] - groups).square().sum(-1)
        assert (e1 <= e0 * (1 + 1e-6)).all()
        assert torch.equal(s1, s1.half().float()) and torch.equal(z1, z1.round())
        assert ((z1 >= min_zero) & (z1 <= 15)).all()
        assert torch.equal(quantize_int(groups, 4, 32, min_zero, search=True).scales.squeeze(-1), s1)
    assert (e1 < e0).float().mean() < 1  # random groups: some keep the min/max grid
    s0, z0 = group_params(w, 4, min_zero)
    s1, z1 = search_group_params(w, 4, min_zero)
    e_minmax = (fake_quantize(w, 4, 32, min_zero) - w).square().sum()
    e_search = (quantize_int(w, 4, 32, min_zero, search=True).dequantize() - w).square().sum()
    assert e_search < 0.7 * e_minmax
    with pytest.raises(ValueError, match="n_scales=0"):
        search_group_params(w, 4, n_scales=0)


def test_gptq_bad_arguments_name_the_field():
    w, h = torch.randn(8, 32), torch.eye(32)
    with pytest.raises(ValueError, match="group_size=24"):
        gptq_quantize(w, h, 4, 24)
    with pytest.raises(ValueError, match="hessian"):
        gptq_quantize(w, torch.eye(16), 4, 32)
    with pytest.raises(ValueError, match="bits=3"):
        gptq_quantize(w, h, 3, 32)


def _outlier_inputs(m, k, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x[:, ::16] *= 30  # a few outlier channels
    return x


def test_awq_beats_rtn_on_outlier_channels():
    k, n, g = 128, 48, 64
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(6))
    x_cal = _outlier_inputs(512, k, seed=7)
    res = search_scales(w, x_cal, None, 4, g)
    assert res.alpha > 0 and res.loss < res.rtn_loss
    q = awq_quantize(w, res.scales, 4, g)
    w_awq = q.dequantize() / res.scales  # the layer multiplies x / s by the quantized W diag(s)
    x_test = _outlier_inputs(512, k, seed=8)
    assert _output_error(x_test, w, w_awq) < _output_error(x_test, w, quantize_int(w, 4, g).dequantize())
    outliers = torch.arange(0, k, 16)
    assert res.scales[outliers].min() > res.scales.max() / 2  # the outlier channels are the ones scaled up


def test_awq_alpha_zero_is_rtn_and_scales_are_centred():
    mean = torch.tensor([0.5, 2.0, 8.0])
    assert torch.equal(activation_scales(mean, 0.0), torch.ones(3))
    s = activation_scales(mean, 0.5)
    assert torch.isclose(s.max() * s.min(), torch.tensor(1.0))
    w = torch.randn(8, 32)
    x = torch.randn(64, 32)  # no outliers: the search may keep alpha = 0, and never does worse than RTN
    res = search_scales(w, x, None, 4, 32)
    assert res.loss <= res.rtn_loss


def test_scales_are_float16_exact_and_the_grid_holds_zero():
    w = torch.randn(4, 3, 32)
    s, z = group_params(w, 4)
    assert torch.equal(s, s.half().float())
    assert ((z >= 0) & (z <= 15)).all() and torch.equal(z, z.round())
    pos = w.abs()
    s1, z1 = group_params(pos, 4, min_zero=1)
    assert (z1 >= 1).all()
    err = (fake_quantize(pos.reshape(4, 96), 4, 32, min_zero=1) - pos.reshape(4, 96)).abs().max()
    assert err <= s1.max() / 2 + 1e-6


def test_awq_clip_search_trims_outlier_weights_and_never_hurts_a_group():
    k, n, g = 128, 32, 32
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(n, k, generator=gen)
    w[torch.arange(n), torch.randint(0, k, (n,), generator=gen)] *= 8  # one large weight per row
    x = torch.randn(512, k, generator=gen)
    bounds = search_clip(w, x, 4, g)
    org = w.abs().reshape(n, k // g, g).amax(-1)
    assert bounds.shape == org.shape and (bounds <= org).all() and (bounds >= 0.5 * org).all()
    assert (bounds < org).any()

    def group_errors(w_hat):  # each group's share of the output error, as the search measures it
        d = (w_hat - w).reshape(n, k // g, g)
        return torch.einsum("mgk,ngk->mng", x.reshape(-1, k // g, g), d).pow(2).mean(0)

    clipped = quantize_int(clip_groups(w, bounds, g), 4, g).dequantize()
    plain = quantize_int(w, 4, g).dequantize()
    assert (group_errors(clipped) <= group_errors(plain) * (1 + 1e-5)).all()
    x_test = torch.randn(512, k, generator=gen)
    ones = torch.ones(k)
    with_clip = awq_quantize(w, ones, 4, g, x=x).dequantize()
    assert _output_error(x_test, w, with_clip) < _output_error(x_test, w, plain)
