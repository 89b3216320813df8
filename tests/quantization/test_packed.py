"""The packed layout: nibble order, dequantization, exact conversions between forms, and RTN's error bound."""
import pytest
import torch

from rooflm.quantization.packed import (PackedWeight, cat_rows, codes, dequantize, pack_int4, to_bits8,
                                        unpack_int4, with_group_size)
from rooflm.quantization.rtn import quantize_rtn


def test_int4_nibble_order_low_first():
    q = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.tolist() == [[1 | (2 << 4), 15]]
    assert torch.equal(unpack_int4(packed), q)


@pytest.mark.parametrize("bits,group", [(8, 64), (4, 32), (4, 64)])
def test_rtn_error_within_half_a_step(bits, group):
    torch.manual_seed(0)
    w = torch.randn(24, 64)
    pw = quantize_rtn(w, bits, group, dtype=torch.float32)
    err = (dequantize(pw) - w).abs().reshape(24, 64 // group, group)
    step = pw.scales.unsqueeze(-1)
    # round to nearest: at most half a step, plus the clamp of the zero point to [0, 15] (never hit: the range
    # always contains 0)
    assert (err <= step / 2 + 1e-6).all()
    assert codes(pw).min() >= (-127 if bits == 8 else 0)
    assert codes(pw).max() <= (127 if bits == 8 else 15)


def test_rtn_keeps_zero_exact():
    w = torch.randn(4, 32)
    w[:, 5] = 0
    assert torch.equal(dequantize(quantize_rtn(w, 4, 32, dtype=torch.float32))[:, 5], torch.zeros(4))


def test_to_bits8_and_smaller_groups_keep_the_values():
    torch.manual_seed(1)
    pw = quantize_rtn(torch.randn(8, 64), 4, 32, dtype=torch.float32)
    ref = dequantize(pw)
    # the same value up to float32 rounding of the shifted min
    torch.testing.assert_close(dequantize(to_bits8(pw)), ref, rtol=0, atol=1e-6)
    assert torch.equal(dequantize(with_group_size(pw, 16)), ref)
    with pytest.raises(ValueError, match="group_size=24"):
        with_group_size(pw, 24)


def test_cat_rows_mixed_formats():
    torch.manual_seed(2)
    a = quantize_rtn(torch.randn(8, 64), 4, 32, dtype=torch.float32)
    b = quantize_rtn(torch.randn(4, 64), 8, 64, dtype=torch.float32)
    fused = cat_rows([a, b])
    assert fused.bits == 8 and fused.group_size == 32
    torch.testing.assert_close(dequantize(fused), torch.cat([dequantize(a), dequantize(b)]), rtol=0, atol=1e-6)


def test_perm_unpermutes_columns():
    torch.manual_seed(3)
    w = torch.randn(4, 32)
    perm = torch.randperm(32)
    pw = quantize_rtn(w[:, perm], 8, 32, dtype=torch.float32)
    pw.perm = perm
    stored = dequantize(pw, unpermute=False)
    full = dequantize(pw)
    assert torch.equal(full[:, perm], stored)
    x = torch.randn(3, 32)
    assert torch.allclose(x @ full.T, x[:, perm] @ stored.T, atol=1e-5)


def test_bad_layouts_name_the_field():
    with pytest.raises(ValueError, match="bits=3"):
        PackedWeight(torch.zeros(2, 2, dtype=torch.uint8), torch.ones(2, 1), None, 3, 4)
    with pytest.raises(ValueError, match="group_size=3"):
        PackedWeight(torch.zeros(2, 4, dtype=torch.int8), torch.ones(2, 1), None, 8, 3)
    with pytest.raises(ValueError, match="scales has shape"):
        PackedWeight(torch.zeros(2, 4, dtype=torch.int8), torch.ones(2, 2), None, 8, 4)


def test_reference_matmul_matches_float_weight():
    torch.manual_seed(4)
    from rooflm.quantization.packed import quant_linear_reference

    perm = torch.randperm(64)
    pw = quantize_rtn(torch.randn(16, 64), 4, 32, dtype=torch.float32)
    pw.perm = perm
    x = torch.randn(5, 64)
    torch.testing.assert_close(quant_linear_reference(x, pw), x @ dequantize(pw).T, rtol=1e-5, atol=1e-5)
