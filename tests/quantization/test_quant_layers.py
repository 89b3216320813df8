"""Linear and LMHead holding quantized weights: the float weight is released, the packed tensors travel as buffers,
the matmul is the packed reference (or the fp8 twin), and the fused projections fall back to their two steps."""
from __future__ import annotations

import pytest
import torch

import rooflm.layers.linear as linear_mod
from rooflm.layers.activation import SiluAndMul, SiluAndMulLinear, silu_and_mul
from rooflm.layers.custom_op import TRITON
from rooflm.layers.embedding import LMHead, VocabEmbedding
from rooflm.layers.linear import Linear
from rooflm.layers.norm import RMSNorm, RMSNormLinear, add_rms_norm
from rooflm.quantization.fp8 import (FP8_MAX, fp8_linear_reference, quantize_fp8_per_token, quantize_fp8_weight)
from rooflm.quantization.packed import dequantize, quant_linear_reference
from rooflm.quantization.rtn import quantize_rtn


def _linear(k: int = 64, n: int = 48, bias: bool = True, seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    layer = Linear(k, n, bias=bias)
    layer.weight.data.normal_(0, 0.1)
    if bias:
        layer.bias.data.normal_(0, 0.5)
    return layer


@pytest.mark.parametrize("bits,group", [(8, 64), (4, 32)])
def test_packed_linear_releases_float_weight_and_matches_reference(bits, group):
    layer = _linear()
    w = layer.weight.detach().clone()
    pw = quantize_rtn(w, bits, group)
    x = torch.randn(5, 64)
    layer.set_packed(pw)
    assert layer.quantized and layer.weight is None
    assert [n for n, _ in layer.named_parameters()] == ["bias"]  # the float weight is gone
    assert {"qweight", "scales"} <= set(dict(layer.named_buffers()))
    assert layer.packed_weight.bits == bits and layer.packed_weight.group_size == group
    torch.testing.assert_close(layer(x), quant_linear_reference(x, pw, layer.bias), rtol=0, atol=0)
    # the quantized matmul is close to the float one, and not equal to it
    ref = torch.nn.functional.linear(x, w, layer.bias)
    err = (layer(x) - ref).abs().max().item()
    assert 0 < err < (0.02 if bits == 8 else 0.2) * ref.abs().max().item()


def test_packed_linear_moves_with_to_and_state_dict():
    layer = _linear()
    layer.set_packed(quantize_rtn(layer.weight.detach(), 4, 32))
    half = layer.to(torch.float64)  # floating buffers convert (scales, mins); the codes stay uint8
    assert half.packed_weight.scales.dtype == torch.float64 and half.packed_weight.qweight.dtype == torch.uint8
    assert half.packed_weight.scales is half.scales  # the view follows the moved buffers
    x = torch.randn(3, 64, dtype=torch.float64)
    torch.testing.assert_close(half(x), quant_linear_reference(x, half.packed_weight, half.bias))
    state = layer.state_dict()
    assert set(state) == {"bias", "qweight", "scales", "mins"}
    other = _linear(seed=1)
    other.set_packed(quantize_rtn(other.weight.detach(), 4, 32))
    other.load_state_dict(state)
    torch.testing.assert_close(other(x.float()), layer.float()(x.float()))


def test_set_packed_checks_the_shape():
    layer = _linear()
    with pytest.raises(ValueError, match=r"packed weight has shape \(48, 32\), expected \(48, 64\)"):
        layer.set_packed(quantize_rtn(torch.randn(48, 32), 8))


def test_the_native_path_calls_quant_linear_native_for_linear_and_lm_head(monkeypatch):
    """One module-level function serves every packed layer of the reference path (a faster CPU kernel replaces it
    in one place)."""
    calls = []
    real = linear_mod.quant_linear_native

    def spy(x, pw, bias=None):
        calls.append(pw.out_features)
        return real(x, pw, bias)

    monkeypatch.setattr(linear_mod, "quant_linear_native", spy)
    layer = _linear()
    layer.set_packed(quantize_rtn(layer.weight.detach(), 8))
    head = LMHead(40, 64)
    head.weight.data.normal_()
    head.set_packed(quantize_rtn(head.weight.detach(), 4, 64))
    x = torch.randn(2, 64)
    layer(x)
    out = head(x)
    assert calls == [48, 40]
    assert out.dtype == torch.float32 and out.shape == (2, 40)


def test_tied_lm_head_gets_its_own_packed_copy_and_the_embedding_stays_float():
    emb = VocabEmbedding(40, 64)
    emb.weight.data.normal_()
    head = LMHead(40, 64, tie_to=emb)
    before = emb.weight.detach().clone()
    head.set_packed(quantize_rtn(emb.weight.detach(), 8))
    assert head.weight is None and isinstance(emb.weight, torch.nn.Parameter)
    assert torch.equal(emb.weight, before)
    ids = torch.tensor([0, 5, 39])
    torch.testing.assert_close(emb(ids), before[ids])
    x = torch.randn(3, 64)
    torch.testing.assert_close(head(x), quant_linear_reference(x, head.packed_weight).float())
    assert head.weight_nbytes < before.numel() * before.element_size()


def test_rmsnorm_linear_falls_back_when_proj_is_packed():
    """The fused GEMV reads proj.weight; a packed proj makes the Triton path run norm, then the packed matmul."""
    torch.manual_seed(0)
    norm = RMSNorm(64)
    norm.weight.data.normal_(1, 0.1)
    proj = _linear(bias=False)
    proj.set_packed(quantize_rtn(proj.weight.detach(), 4, 32))
    op = RMSNormLinear(norm, proj)
    op._set_impl(TRITON)  # the fused path's decision, as on a GPU, with both parts on the reference path
    op.fuse = True
    x, res = torch.randn(3, 64), torch.randn(3, 64)
    out, new_res = op(x, res)
    h, want_res = add_rms_norm(x, res, norm.weight, norm.eps)
    torch.testing.assert_close(out, quant_linear_reference(h, proj.packed_weight))
    torch.testing.assert_close(new_res, want_res)


def test_silu_and_mul_linear_falls_back_when_proj_is_packed():
    torch.manual_seed(0)
    proj = _linear(k=32, n=64, bias=True)
    proj.set_packed(quantize_rtn(proj.weight.detach(), 8))
    op = SiluAndMulLinear(SiluAndMul(), proj)
    op._set_impl(TRITON)
    op.fuse = True
    gate_up = torch.randn(2, 64)
    torch.testing.assert_close(op(gate_up), quant_linear_reference(silu_and_mul(gate_up), proj.packed_weight,
                                                                   proj.bias))


def test_fp8_weight_rounding_is_within_half_an_e4m3_step():
    torch.manual_seed(0)
    w = torch.randn(32, 64)
    fw = quantize_fp8_weight(w)
    assert fw.weight.dtype == torch.float8_e4m3fn and fw.scale.shape == (32,)
    deq = fw.weight.float() * fw.scale[:, None]
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal numbers; below 2^-6 (subnormals) the step is
    # 2^-9, in units of the row's scale
    bound = w.abs() / 16 + fw.scale[:, None] * 2.0 ** -10
    assert ((deq - w).abs() <= bound + 1e-7).all()
    assert torch.allclose(w.abs().amax(1), deq.abs().amax(1), rtol=1e-6)  # each row's max maps to 448
    xq, sx = quantize_fp8_per_token(torch.randn(4, 64))
    assert sx.shape == (4, 1) and xq.float().abs().amax(1).eq(FP8_MAX).all()


def test_fp8_linear_twin_is_close_to_float():
    layer = _linear(k=128, n=64)
    w = layer.weight.detach().clone()
    x = torch.randn(6, 128)
    ref = torch.nn.functional.linear(x, w, layer.bias)
    layer.set_fp8(quantize_fp8_weight(w))
    assert layer.quant == "fp8" and layer.weight is None
    out = layer(x)
    torch.testing.assert_close(out, fp8_linear_reference(x, layer.fp8_weight, layer.bias))
    err = (out - ref).abs().max().item()
    assert 0 < err < 0.05 * ref.abs().max().item()
    assert layer.weight_nbytes == 64 * 128 + 64 * 4
    # a dtype cast changes the compute dtype only: the fp8 codes and float32 scales are kept as they are
    codes, scale = layer.weight_fp8.clone(), layer.weight_scale.clone()
    layer.to(torch.float64)
    assert torch.equal(layer.weight_fp8.float(), codes.float()) and layer.weight_fp8.dtype == torch.float8_e4m3fn
    assert torch.equal(layer.weight_scale, scale) and layer.bias.dtype == torch.float64
    out64 = layer(x.double())
    assert out64.dtype == torch.float64
    torch.testing.assert_close(out64, fp8_linear_reference(x.double(), layer.fp8_weight, layer.bias))


def test_dequantized_packed_weight_is_what_the_layer_multiplies():
    layer = _linear(bias=False)
    pw = quantize_rtn(layer.weight.detach(), 4, 16)
    layer.set_packed(pw)
    x = torch.eye(64)
    torch.testing.assert_close(layer(x), dequantize(pw).T)


def test_fp8_is_refused_on_a_gpu_without_fp8_tensor_cores(monkeypatch, tiny_config):
    from rooflm.loader import load_model
    from rooflm.quantization.fp8 import check_fp8_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"quantization='fp8' needs a GPU of compute capability >= 8.9.*\(8, 0\)"):
        check_fp8_device("cuda:0")
    check_fp8_device("cpu")  # the CPU runs the twin
    with pytest.raises(ValueError, match=r"quantization='fp8' needs a GPU"):
        load_model(str(tiny_config), device="cuda", quantization="fp8", show_progress=False)
