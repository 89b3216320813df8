"""The one-pass per-token fp8 quantization kernel (rooflm/kernels/fp8_quant.py) against its torch twin,
``quantize_fp8_per_token_reference``: codes and scales bit for bit, on rows of odd widths, a zero row, rows whose
values reach past the e4m3 range after scaling, and every activation dtype. On the CPU it runs under Triton's
interpreter; on CUDA the same test runs on the GPU (where ``quantize_fp8_per_token`` dispatches to it)."""
from __future__ import annotations

import pytest
import torch


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [64, 100, 576])
def test_codes_and_scales_equal_the_reference(dtype: torch.dtype, k: int) -> None:
    from rooflm.kernels.fp8_quant import quantize_rows_fp8
    from rooflm.quantization.fp8 import _MIN_SCALE, FP8_DTYPE, FP8_MAX, quantize_fp8_per_token_reference

    g = torch.Generator().manual_seed(k)
    x = torch.randn(5, k, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 1e3, 0.0])[:, None]
    x[1, 3] = 50.0  # one outlier sets the scale of its row
    x = x.to(_device(), dtype)
    q, s = quantize_rows_fp8(x, FP8_DTYPE, FP8_MAX, _MIN_SCALE)
    q_ref, s_ref = quantize_fp8_per_token_reference(x)
    assert q.dtype == FP8_DTYPE and q.shape == (5, k) and s.shape == (5, 1) and s.dtype == torch.float32
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert float(s[4]) == pytest.approx(_MIN_SCALE) and not q[4].float().any()  # a zero row keeps a finite scale


def test_a_strided_input_and_an_empty_one() -> None:
    from rooflm.kernels.fp8_quant import quantize_rows_fp8
    from rooflm.quantization.fp8 import _MIN_SCALE, FP8_DTYPE, FP8_MAX, quantize_fp8_per_token_reference

    base = torch.randn(6, 96, generator=torch.Generator().manual_seed(1)).to(_device())
    x = base[::2, 16:80]  # rows 2 apart, columns offset: the kernel reads by the row stride
    q, s = quantize_rows_fp8(x, FP8_DTYPE, FP8_MAX, _MIN_SCALE)
    q_ref, s_ref = quantize_fp8_per_token_reference(x)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    q0, s0 = quantize_rows_fp8(base[:0], FP8_DTYPE, FP8_MAX, _MIN_SCALE)
    assert q0.shape == (0, 96) and s0.shape == (0, 1)
    with pytest.raises(ValueError, match="2-D"):
        quantize_rows_fp8(base[0], FP8_DTYPE, FP8_MAX, _MIN_SCALE)


def test_ties_round_to_even_at_every_scale_of_the_grid() -> None:
    """A row whose maximum is 448 has scale 1, so the listed values reach the rounding unchanged: exact ties between
    two e4m3 neighbours (normal and subnormal), the top of the range, values that round up into the next binade, and
    signed zeros."""
    from rooflm.kernels.fp8_quant import quantize_rows_fp8
    from rooflm.quantization.fp8 import _MIN_SCALE, FP8_DTYPE, FP8_MAX, quantize_fp8_per_token_reference

    sub = 2.0 ** -9  # the subnormal spacing of e4m3
    vals = [448.0, 124.0, -124.0, 8.5, 9.5, 125.7, 15.9, 1.5 * sub, 0.5 * sub, -0.5 * sub, 2.5 * sub,
            2.0 ** -6 - sub / 4, 2.0 ** -6 + 2.0 ** -10, -0.0, 0.0, 440.0, 436.0]
    x = torch.tensor([vals], dtype=torch.float32, device=_device())
    q, s = quantize_rows_fp8(x, FP8_DTYPE, FP8_MAX, _MIN_SCALE)
    q_ref, s_ref = quantize_fp8_per_token_reference(x)
    assert float(s[0]) == 1.0 and torch.equal(s, s_ref)
    assert q.view(torch.uint8).tolist() == q_ref.view(torch.uint8).tolist()
    assert q.float()[0, :5].tolist() == [448.0, 128.0, -128.0, 8.0, 10.0]  # ties went to the even mantissa


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_and_quantization_in_one_kernel_equal_the_two_kernels(dtype: torch.dtype, with_residual: bool) -> None:
    """The fused add + RMSNorm + quantization writes the codes, scales and residual stream that the RMSNorm kernel
    followed by the quantization kernel write, bit for bit (rows of a width that is not a power of two, one row of
    large values, one of zeros)."""
    from rooflm.kernels.fp8_quant import quantize_rows_fp8, rms_norm_quantize_fp8
    from rooflm.kernels.rmsnorm import rms_norm, rms_norm_ref
    from rooflm.quantization.fp8 import _MIN_SCALE, FP8_DTYPE, FP8_MAX, quantize_fp8_per_token_reference

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 96, generator=g) * torch.tensor([1.0, 20.0, 0.0, 3.0])[:, None]).to(_device(), dtype)
    res = (torch.randn(4, 96, generator=g) * 2).to(_device(), dtype) if with_residual else None
    w = (torch.rand(96, generator=g) + 0.5).to(_device(), dtype)
    q, s, r = rms_norm_quantize_fp8(x, w, 1e-5, res, FP8_DTYPE, FP8_MAX, _MIN_SCALE)
    if with_residual:
        h, r_ref = rms_norm(x, w, 1e-5, res)
        assert torch.equal(r, r_ref) and not torch.equal(r, x)
    else:
        h = rms_norm(x, w, 1e-5)
        assert r is x
    q_ref, s_ref = quantize_rows_fp8(h, FP8_DTYPE, FP8_MAX, _MIN_SCALE)
    assert q.shape == (4, 96) and s.shape == (4, 1)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    # and the codes dequantize to the torch twin's normalised rows within one step of fp8's grid (a last-place
    # difference of the norm in bfloat16 may move a value across a rounding boundary of the 3-bit mantissa)
    h_twin = rms_norm_ref(x, w, 1e-5, res)
    h_twin = h_twin[0] if with_residual else h_twin
    q_twin, s_twin = quantize_fp8_per_token_reference(h_twin)
    assert torch.allclose(q.float() * s, q_twin.float() * s_twin, rtol=0.13, atol=1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_quantize_fp8(x, w, 1e-5, x[:2], FP8_DTYPE, FP8_MAX, _MIN_SCALE)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_silu_mul_and_quantization_in_one_kernel_equal_the_two_kernels(dtype: torch.dtype) -> None:
    from rooflm.kernels.activation import silu_and_mul
    from rooflm.kernels.fp8_quant import quantize_rows_fp8, silu_and_mul_quantize_fp8
    from rooflm.quantization.fp8 import _MIN_SCALE, FP8_DTYPE, FP8_MAX

    g = torch.Generator().manual_seed(4)
    x = (torch.randn(3, 2 * 80, generator=g) * torch.tensor([1.0, 6.0, 0.0])[:, None]).to(_device(), dtype)
    q, s = silu_and_mul_quantize_fp8(x, FP8_DTYPE, FP8_MAX, _MIN_SCALE)
    q_ref, s_ref = quantize_rows_fp8(silu_and_mul(x), FP8_DTYPE, FP8_MAX, _MIN_SCALE)
    assert q.shape == (3, 80) and s.shape == (3, 1)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    with pytest.raises(ValueError, match="gate"):
        silu_and_mul_quantize_fp8(x[:, :-1], FP8_DTYPE, FP8_MAX, _MIN_SCALE)
