"""The one-row 4-bit GEMV on tensor cores (rooflm/kernels/quant_gemv_mma.py) against its twin,
``quant_linear_reference`` in float64 on the same dequantized weight: one to eight warps (row blocks) a program,
with and without prefetch, K split evenly and unevenly, groups of 128 and 256 columns and one a row,
with and without mins and bias; and in a CUDA graph with programmatic dependent launch."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from test_quant_gemm import make_packed  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _tensor_core_layout_on(monkeypatch):
    """``with_mma`` lays out weights only where ROOFLM_QUANT_MMA=1 (off by default)."""
    monkeypatch.setenv("ROOFLM_QUANT_MMA", "1")


def _check(pw, cfg, bias, seed=0):
    """``pw`` carries its tensor-core layout (``with_mma``)."""
    from rooflm.kernels.quant_gemv_mma import launch_mma_gemv
    from rooflm.quantization.packed import quant_linear_reference

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, pw.in_features, generator=g).half().cuda()
    b = torch.randn(pw.out_features, generator=g).half().cuda() if bias else None
    out = launch_mma_gemv(x, pw, b, cfg)
    ref = quant_linear_reference(x.double(), pw, None if b is None else b.double())
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert out.shape == (1, pw.out_features) and out.dtype == torch.float16
    # The weights are the float16 dequantized ones and the products are summed in float32: the error is the
    # output's own rounding (the word GEMV's float16 products give about 1e-3).
    assert rel < 5e-4, f"{cfg} N={pw.out_features} K={pw.in_features} group={pw.group_size}: {rel:.2e}"


def _configs():
    from rooflm.kernels.quant_gemv_mma import MmaGemvConfig

    return [None, MmaGemvConfig(1, 1, False), MmaGemvConfig(2, 1, True), MmaGemvConfig(4, 3, True),
            MmaGemvConfig(2, 5, False), MmaGemvConfig(8, 4, True)]


@pytest.mark.parametrize("n,k,group,mins", [(4096, 4096, 128, True), (1152, 11008, 128, True),
                                            (512, 1536, 256, False), (256, 2048, 2048, True)])
@pytest.mark.parametrize("bias", [False, True])
def test_mma_gemv_matches_the_reference(n, k, group, mins, bias):
    from rooflm.kernels.quant_gemv_mma import with_mma

    pw = with_mma(make_packed(n, k, 4, group, mins=mins, perm=False, dtype=torch.float16, device="cuda"))
    assert pw.mma is not None
    for cfg in _configs():
        _check(pw, cfg, bias)


def test_mma_gemv_is_closer_to_the_reference_than_the_word_gemv():
    """Same weight and x: the tensor cores multiply float16 weights exactly and add in float32, the word GEMV rounds
    its products to float16."""
    from rooflm.kernels.quant_gemv import launch_gemv
    from rooflm.kernels.quant_gemv_mma import launch_mma_gemv, with_mma
    from rooflm.quantization.packed import quant_linear_reference

    pw = with_mma(make_packed(4096, 4096, 4, 128, mins=True, perm=False, dtype=torch.float16, device="cuda"))
    x = torch.randn(1, 4096, device="cuda").half()
    ref = quant_linear_reference(x.double(), pw)
    err_mma = (launch_mma_gemv(x, pw).double() - ref).norm() / ref.norm()
    err_word = (launch_gemv(x, pw, None).double() - ref).norm() / ref.norm()
    assert err_mma < err_word


def test_mma_gemv_replays_in_a_cuda_graph_with_dependent_launch():
    """Captured with the launch flags of a decode step (trigger and wait); new inputs written into the captured
    buffer give the new results, bit for bit those of a plain launch."""
    from rooflm.kernels.quant_gemv_mma import MmaGemvConfig, launch_mma_gemv, with_mma

    pw = with_mma(make_packed(2048, 4096, 4, 128, mins=True, perm=False, dtype=torch.float16, device="cuda"))
    x = torch.randn(1, 4096, device="cuda").half()
    for cfg in (MmaGemvConfig(4, 1, True), MmaGemvConfig(2, 4, True)):
        launch_mma_gemv(x, pw, None, cfg, pdl_trigger=1, pdl_wait=True)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = launch_mma_gemv(x, pw, None, cfg, pdl_trigger=1, pdl_wait=True)
        for seed in (1, 2):
            x.copy_(torch.randn(1, 4096, generator=torch.Generator().manual_seed(seed)).half())
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, launch_mma_gemv(x, pw, None, cfg)), cfg


def test_quant_linear_takes_the_tensor_core_gemv_where_picked():
    """A weight with the tensor-core layout: ``pick_gemv`` times it beside the word GEMV, ``quant_linear`` runs the
    pick within the reference's tolerance, and the word GEMV's fused epilogues refuse a tensor-core configuration."""
    from rooflm.kernels.quant_gemm import quant_linear
    from rooflm.kernels.quant_gemv import launch_gemv, pick_gemv
    from rooflm.kernels.quant_gemv_mma import MmaGemvConfig, with_mma
    from rooflm.quantization.packed import quant_linear_reference

    pw = with_mma(make_packed(4096, 4096, 4, 128, mins=True, perm=False, dtype=torch.float16, device="cuda"))
    assert pw.mma is not None
    x = torch.randn(1, 4096, device="cuda").half()
    pick = pick_gemv(x, pw, None)
    ref = quant_linear_reference(x.double(), pw)
    out = quant_linear(x, pw)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-3, pick
    with pytest.raises(ValueError, match="epilogue"):
        launch_gemv(x, pw, None, MmaGemvConfig(), silu_mul=True)
