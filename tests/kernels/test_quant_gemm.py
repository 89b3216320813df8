"""The weight-only quantized matmul kernels (rooflm/kernels/quant_gemm.py) against their twin,
``quant_linear_reference``: every program shape (GEMV, flat GEMM on tl.dot, GEMM), every scale layout (one group a
tile, whole groups a tile, per-column gather), split-K, int4 and int8 codes, with and without mins, bias and act-order
permutation. On the CPU the kernels run under Triton's interpreter on small shapes; on CUDA the same tests use larger
ones."""
from __future__ import annotations

import pytest
import torch

CPU_NK = {"n": 37, "k": 256, "k_channel": 192}  # odd N; a per-channel K that no power-of-two tile divides
GPU_NK = {"n": 1029, "k": 4096, "k_channel": 4160}
LIMIT = {torch.float16: 2e-3, torch.bfloat16: 1.2e-2, torch.float32: 2e-5}


def _shapes(device: str) -> dict:
    return GPU_NK if device == "cuda" else CPU_NK


def make_packed(n: int, k: int, bits: int, group_size: int, mins: bool, perm: bool, dtype: torch.dtype,
                device: str, seed: int = 0):
    """A random PackedWeight: uniform codes over the whole range, positive scales of varying size, mins of either
    sign (the zero-point form is -scale * z), optionally a random act-order permutation."""
    from rooflm.quantization.packed import PackedWeight, pack_int4

    g = torch.Generator().manual_seed(seed)
    groups = k // group_size
    if bits == 4:
        qweight = pack_int4(torch.randint(0, 16, (n, k), generator=g))
        scale = 2.0 / (15 * k ** 0.5)
    else:
        qweight = torch.randint(-128, 128, (n, k), generator=g).to(torch.int8)
        scale = 2.0 / (127 * k ** 0.5)
    scales = scale * (0.5 + torch.rand(n, groups, generator=g))
    mn = -7.5 * scales * (0.8 + 0.4 * torch.rand(n, groups, generator=g)) if mins else None
    p = torch.randperm(k, generator=g) if perm else None
    return PackedWeight(qweight=qweight, scales=scales, mins=mn, bits=bits, group_size=group_size,
                        perm=p).to(device, dtype)


def check(m: int, pw, dtype: torch.dtype, device: str, bias: bool, cfg=None, seed: int = 0) -> None:
    """quant_linear against the twin computed in float64 on the same dequantized weight."""
    from rooflm.kernels.quant_gemm import quant_linear
    from rooflm.quantization.packed import quant_linear_reference

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, pw.in_features, generator=g).to(dtype).to(device)
    b = torch.randn(pw.out_features, generator=g).to(dtype).to(device) if bias else None
    out = quant_linear(x, pw, b, cfg=cfg)
    ref = quant_linear_reference(x.double(), pw, None if b is None else b.double())
    what = (f"bits={pw.bits} group={pw.group_size} mins={pw.mins is not None} perm={pw.perm is not None} "
            f"bias={bias} M={m} N={pw.out_features} K={pw.in_features} {dtype} {cfg}")
    assert out.shape == (m, pw.out_features) and out.dtype == dtype, what
    assert not torch.isnan(out).any(), f"{what}: NaN in output"
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    worst = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert rel < LIMIT[dtype] and worst < 4 * LIMIT[dtype], f"{what}: relative error {rel:.2e}, worst {worst:.2e}"


GROUPS = [16, 32, 64, 128, 256, "channel"]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("mins", [True, False])
def test_quant_linear_default_configs(device, bits, group, mins):
    """The configuration quant_linear picks by itself, at every row count: GEMV (M = 1), flat GEMM (3, 16), GEMM
    (17, 64). Bias and permutation alternate over the parameter grid so each meets both bit widths and mins."""
    s = _shapes(device)
    k = s["k_channel"] if group == "channel" else s["k"]
    gs = k if group == "channel" else group
    i = GROUPS.index(group)
    bias, perm = (i + mins) % 2 == 0, (i + bits // 4) % 2 == 0
    pw = make_packed(s["n"], k, bits, gs, mins, perm, torch.float16, device, seed=i)
    for m in (1, 3, 16, 17, 64):
        check(m, pw, torch.float16, device, bias, seed=m + i)


def _forced_configs():
    from rooflm.kernels.quant_gemm import QuantMMConfig

    return [
        QuantMMConfig(1, 16, 128, x_split=1),  # GEMV, x loaded with stride 2
        QuantMMConfig(1, 8, 64, split_k=3, x_split=0),  # GEMV, split-K, nibbles interleaved
        QuantMMConfig(1, 16, 32, x_split=2),  # GEMV, x split in registers
        QuantMMConfig(16, 16, 64, x_split=1),  # flat GEMM
        QuantMMConfig(16, 32, 32, split_k=2, x_split=0),  # flat GEMM, split-K, 16-byte int4 rows
        QuantMMConfig(16, 16, 128, x_split=2),  # flat GEMM
        QuantMMConfig(32, 16, 64, x_split=0),  # GEMM
        QuantMMConfig(32, 32, 128, split_k=3, x_split=1),  # GEMM, split-K
    ]


@pytest.mark.parametrize("ci", range(8))
@pytest.mark.parametrize("bits", [4, 8])
def test_quant_linear_forced_configs(device, ci, bits):
    """Each program shape, nibble order and split against every scale layout: group 32 (a tile inside a group or a
    gather, by tile width), group 48 (no power-of-two tile fits: gather), per channel; N even and odd."""
    cfg = _forced_configs()[ci]
    k = 192 if device == "cpu" else 1536
    for j, (group, n) in enumerate([(32, 64), (48, 37), (k, 37)]):
        pw = make_packed(n, k, bits, group, mins=j != 1, perm=j == 2, dtype=torch.float16, device=device,
                         seed=ci + j)
        for m in ([1] if cfg.block_m == 1 else [2, 16, 40]):
            check(m, pw, torch.float16, device, bias=(ci + j) % 2 == 1, cfg=cfg, seed=m)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits", [4, 8])
def test_quant_linear_dtypes(device, dtype, bits):
    s = _shapes(device)
    pw = make_packed(s["n"], s["k"], bits, 64, mins=True, perm=bits == 8, dtype=dtype, device=device, seed=bits)
    for m in (1, 5, 20):
        check(m, pw, dtype, device, bias=m == 5, seed=m)


def test_quant_linear_scales_in_another_dtype(device):
    """fp16 scales with bf16 activations: the product is in x's dtype (the twin's contract)."""
    pw = make_packed(24, 128, 4, 32, mins=True, perm=False, dtype=torch.float16, device=device)
    for m in (1, 4, 24):
        check(m, pw, torch.bfloat16, device, bias=False, seed=m)


def test_split_k_is_deterministic_and_matches_one_split(device):
    from rooflm.kernels.quant_gemm import QuantMMConfig, quant_linear

    pw = make_packed(40, 256, 4, 32, mins=True, perm=False, dtype=torch.float16, device=device)
    x = torch.randn(3, 256).half().to(device)
    split = [quant_linear(x, pw, cfg=QuantMMConfig(16, 16, 32, split_k=4)) for _ in range(2)]
    one = quant_linear(x, pw, cfg=QuantMMConfig(16, 16, 32, split_k=1))
    assert torch.equal(split[0], split[1]), "split-K must add its partial sums in a fixed order"
    torch.testing.assert_close(split[0], one, atol=2e-3, rtol=1e-2)


def test_quant_linear_keeps_leading_dims(device):
    from rooflm.kernels.quant_gemm import quant_linear

    pw = make_packed(24, 64, 8, 32, mins=False, perm=False, dtype=torch.float16, device=device)
    x = torch.randn(2, 3, 64).half().to(device)
    out = quant_linear(x, pw)
    assert out.shape == (2, 3, 24)
    torch.testing.assert_close(out.reshape(6, 24), quant_linear(x.reshape(6, 64), pw), atol=0, rtol=0)
    assert quant_linear(x[:0, 0], pw).shape == (0, 24)


def test_default_config_shapes():
    """The heuristic's program shapes: GEMV at M = 1, 16-row tl.dot tiles up to 16 rows, GEMM above; tiles inside
    one group for power-of-two groups of 32 columns and more; split-K when N alone leaves the SMs idle."""
    from rooflm.kernels.quant_gemm import default_config, per_row_scales

    assert default_config(1, 4096, 4096, 4, 128, 132).block_m == 1
    assert default_config(2, 4096, 4096, 4, 128, 132).block_m == 16
    assert default_config(16, 4096, 4096, 8, 4096, 132).block_m == 16
    assert default_config(17, 4096, 4096, 4, 128, 132).block_m > 16
    for m in (1, 2, 16, 64, 300):
        for g in (32, 64, 128, 256, 4096):
            cfg = default_config(m, 4096, 4096, 4, g, 132)
            assert per_row_scales(cfg, 4096, g), (m, g, cfg)
    assert not per_row_scales(default_config(1, 4096, 4096, 4, 16, 132), 4096, 16)  # 8-byte rows: gather instead
    assert default_config(1, 4096, 4096, 4, 128, 132).split_k > 1  # 256 programs for 528 wanted
    assert default_config(1, 32000, 4096, 4, 128, 132).split_k == 1


def test_bad_input_is_rejected(device):
    from rooflm.kernels.quant_gemm import QuantMMConfig, quant_linear
    from rooflm.quantization.packed import PackedWeight, pack_int4

    pw = make_packed(16, 64, 4, 32, mins=True, perm=False, dtype=torch.float16, device=device)
    x = torch.randn(2, 64).half().to(device)
    with pytest.raises(ValueError, match="x has shape"):
        quant_linear(torch.randn(2, 48).half().to(device), pw)
    with pytest.raises(ValueError, match="x.dtype"):
        quant_linear(x.double(), pw)
    with pytest.raises(ValueError, match="bias"):
        quant_linear(x, pw, torch.zeros(15).half().to(device))
    odd = PackedWeight(pack_int4(torch.zeros(16, 42, dtype=torch.uint8)), torch.ones(16, 2), None, 4, 21)
    with pytest.raises(ValueError, match="group_size=21"):
        quant_linear(torch.randn(2, 42).to(device), odd.to(device))
    with pytest.raises(ValueError, match="M=2"):
        quant_linear(x, pw, cfg=QuantMMConfig(1, 16, 64))
    with pytest.raises(ValueError, match="block_n"):
        QuantMMConfig(16, 24, 64)
    with pytest.raises(ValueError, match="block_k"):
        QuantMMConfig(16, 16, 16)
    with pytest.raises(ValueError, match="x_split"):
        QuantMMConfig(1, 16, 64, x_split=3)
    with pytest.raises(ValueError, match="block_m"):
        QuantMMConfig(8, 16, 64)
    with pytest.raises(ValueError, match="split_k"):
        QuantMMConfig(1, 16, 64, split_k=0)
