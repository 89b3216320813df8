"""torch's CPU integer kernels against the reference matmul, for every form ``prepare_cpu`` picks (the native
kernel, which takes most of these weights when it builds, is switched off here: tests/kernels/test_cpu_native.py)."""
import pytest
import torch

from rooflm.kernels.cpu_quant import prepare_cpu, quant_linear_cpu
from rooflm.quantization.packed import PackedWeight, dequantize, quant_linear_reference
from rooflm.quantization.rtn import quantize_rtn


@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch):
    monkeypatch.setenv("ROOFLM_CPU_NATIVE", "off")


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


CASES = [
    # (bits, group, out rows, in cols, expected kind, split)
    (4, 32, 48, 64, "int4", False),
    (4, 64, 32, 128, "int4", False),
    (4, 128, 16, 256, "int4", False),
    (8, None, 40, 64, "int8", False),  # per-channel, symmetric
    (8, 32, 48, 64, "int4", True),  # grouped int8 (GGUF Q8_0): two int4 halves
    (8, 16, 32, 64, "dense", False),  # groups of 16 (GGUF Q6_K): no integer kernel
    (4, 32, 40, 64, "dense", False),  # rows not a multiple of 16
]


@pytest.mark.parametrize("bits,group,n,k,kind,split", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernels_match_reference(bits, group, n, k, kind, split, dtype):
    gen = torch.Generator().manual_seed(n * k + bits)
    w = torch.randn(n, k, generator=gen)
    pw = quantize_rtn(w, bits, group, dtype=torch.float32)
    if bits == 8 and group is not None and group < k:  # grouped int8 with a min, as GGUF Q5_K has
        pw.mins = torch.randn(n, k // group, generator=gen) * 0.01
    prepared = prepare_cpu(pw)
    assert (prepared.kind, prepared.split) == (kind, split)
    x = torch.randn(5, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    out = quant_linear_cpu(x, prepared, bias)
    assert out.dtype == dtype and out.shape == (5, n)
    ref = quant_linear_reference(x.float(), pw, bias.float())
    # bfloat16 activations and scales: ~3 significant digits
    assert _rel_err(out, ref) < 1.5e-2


def test_perm_gathers_the_input():
    gen = torch.Generator().manual_seed(7)
    perm = torch.randperm(64, generator=gen)
    pw = quantize_rtn(torch.randn(32, 64, generator=gen), 4, 32, dtype=torch.float32)
    pw.perm = perm
    x = torch.randn(3, 64, generator=gen)
    out = quant_linear_cpu(x, prepare_cpu(pw))
    assert _rel_err(out, x @ dequantize(pw).T) < 1.5e-2
    pw_noperm = PackedWeight(pw.qweight, pw.scales, pw.mins, 4, 32)
    assert _rel_err(quant_linear_cpu(x, prepare_cpu(pw_noperm)), x @ dequantize(pw).T) > 0.2


def test_int8_split_is_exact_up_to_bfloat16():
    """The two-halves form of grouped int8 codes equals the dequantized bf16 weight's product: any error in the
    split (a wrong shift, a lost sign) would be far larger than bf16 rounding."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-128, 128, (32, 64), generator=gen, dtype=torch.int8)
    pw = PackedWeight(q, torch.rand(32, 2, generator=gen) + 0.1, torch.randn(32, 2, generator=gen), 8, 32)
    prepared = prepare_cpu(pw)
    assert prepared.split
    x = torch.randn(4, 64, generator=gen)
    ref = x.to(torch.bfloat16).float() @ dequantize(pw, dtype=torch.float32).T
    assert _rel_err(quant_linear_cpu(x, prepared), ref) < 1e-2
