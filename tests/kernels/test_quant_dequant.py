"""The dequantize kernel of the prefill path (rooflm/kernels/quant_dequant.py) against ``packed.dequantize``: 4- and
8-bit codes, groups that do and do not divide the tile, mins or not, ragged N and K; the shared scratch buffer; when
``quant_linear`` takes the path. Runs under Triton's interpreter on the CPU, on the GPU where there is one."""
from __future__ import annotations

import pytest
import torch

from test_quant_gemm import make_packed


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group,k", [(32, 192), (18, 594), (64, 512), ("channel", 300)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequantize_into_matches_reference(device, bits, group, k, dtype):
    from rooflm.kernels.quant_dequant import dequantize_into
    from rooflm.quantization.packed import dequantize

    gs = k if group == "channel" else group
    pw = make_packed(37, k, bits, gs, mins=gs != 64, perm=gs == 18, dtype=torch.float16, device=device, seed=k)
    got = dequantize_into(pw, dtype)
    want = dequantize(pw, dtype, unpermute=False)
    assert got.shape == want.shape and got.dtype == dtype
    if device == "cpu" and dtype == torch.float16:
        assert torch.equal(got, want), "the interpreter computes q * s + m in float32 like the reference"
    else:  # the GPU may contract q * s + m into one FMA, and the interpreter's float32 -> bfloat16 cast may not
        # round to nearest: at most one rounding of the dtype apart
        torch.testing.assert_close(got, want, atol=0, rtol=2 ** -7 if dtype == torch.bfloat16 else 2 ** -10)


def test_scratch_is_reused_and_out_is_checked(device):
    from rooflm.kernels.quant_dequant import dequantize_into
    from rooflm.quantization.packed import dequantize

    big = make_packed(40, 256, 4, 32, mins=True, perm=False, dtype=torch.float16, device=device)
    small = make_packed(24, 128, 8, 64, mins=False, perm=False, dtype=torch.float16, device=device)
    a = dequantize_into(big, torch.float16)
    ptr = a.data_ptr()
    b = dequantize_into(small, torch.float16)
    assert b.data_ptr() == ptr, "a smaller weight reuses the scratch buffer"
    assert torch.equal(b, dequantize(small, torch.float16, unpermute=False))
    out = torch.empty(40, 256, dtype=torch.float16, device=device)
    assert dequantize_into(big, torch.float16, out=out) is out
    assert torch.equal(out, dequantize(big, torch.float16, unpermute=False))
    with pytest.raises(ValueError, match="out has shape"):
        dequantize_into(big, torch.float16, out=torch.empty(40, 128, dtype=torch.float16, device=device))


def test_only_many_cuda_rows_take_the_float_gemm(device):
    from rooflm.kernels.quant_dequant import DEQUANT_MIN_ROWS, use_dequant_gemm

    many = torch.zeros(DEQUANT_MIN_ROWS, 64, dtype=torch.float16, device=device)
    assert use_dequant_gemm(many) == (device == "cuda")
    assert not use_dequant_gemm(many[: DEQUANT_MIN_ROWS - 1])
    assert not use_dequant_gemm(many.float()), "float32 x keeps the exact-product kernels"
