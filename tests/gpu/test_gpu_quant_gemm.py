"""The quantized matmul on CUDA beyond tests/kernels/test_quant_gemm.py (which also runs here, at larger shapes):
capture in a CUDA graph, and the one-time timing of candidate configurations."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from test_quant_gemm import check, make_packed  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("bits", [4, 8])
def test_quant_linear_replays_in_a_cuda_graph(bits):
    """Captured once per row count (GEMV, flat GEMM, GEMM with split-K), replayed on new inputs written into the
    captured buffer: the results follow the inputs, so nothing was fixed at capture time."""
    from rooflm.kernels.quant_gemm import quant_linear
    from rooflm.quantization.packed import quant_linear_reference

    pw = make_packed(1029, 4096, bits, 128, mins=bits == 4, perm=bits == 4, dtype=torch.float16, device="cuda")
    bias = torch.randn(1029, device="cuda", dtype=torch.float16)
    for m in (1, 7, 48):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.float16)
        quant_linear(x, pw, bias)  # compile and pick outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = quant_linear(x, pw, bias)
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize()
            ref = quant_linear_reference(x.double(), pw, bias.double())
            rel = ((out.double() - ref).norm() / ref.norm()).item()
            assert rel < 2e-3, f"M={m}: relative error {rel:.2e} after replay"


def test_timed_pick_is_a_candidate_and_correct(monkeypatch):
    from rooflm.kernels import quant_gemm

    monkeypatch.setenv("ROOFLM_QUANT_TUNE", "1")
    monkeypatch.setattr(quant_gemm, "_picked", {})
    pw = make_packed(2048, 4096, 4, 128, mins=True, perm=False, dtype=torch.float16, device="cuda")
    for m in (1, 8):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.float16)
        cfg = quant_gemm.pick_config(x, pw, None)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert cfg in quant_gemm.candidates(m, 2048, 4096, 4, 128, sms)
        check(m, pw, torch.float16, "cuda", bias=False, cfg=cfg)
    assert len(quant_gemm._picked) == 2


@pytest.mark.parametrize("asm", [0, 1, 2])
@pytest.mark.parametrize("group", [32, 128, "channel"])
@pytest.mark.parametrize("mins", [True, False])
def test_ptx_conversions_of_4bit_codes(asm, group, mins):
    """The lop3 / f16x2 conversions of 4-bit codes (asm 1: codes only, asm 2: also scale and min) against the float64
    twin, for the GEMV, the flat GEMM and the GEMM tiles, nibbles in column or byte order, with and without mins, one
    group a tile and groups gathered per column (asm 2 falls back to 1 there), odd N."""
    from dataclasses import replace

    from rooflm.kernels.quant_gemm import asm_level, default_config, per_row_scales

    k = 4096
    g = k if group == "channel" else group
    pw = make_packed(1029, k, 4, g, mins=mins, perm=False, dtype=torch.float16, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m in (1, 9, 40):
        for xs in (0, 1, 2):  # nibbles put back in column order, or kept in byte order (x strided or split)
            cfg = replace(default_config(m, 1029, k, 4, g, sms), asm=asm, x_split=xs)
            x = torch.zeros(m, k, device="cuda", dtype=torch.float16)
            per_row = per_row_scales(cfg, k, g)
            assert asm_level(cfg, x, pw, per_row) == (asm if asm < 2 or per_row else 1)
            check(m, pw, torch.float16, "cuda", bias=m == 9, cfg=cfg)


@pytest.mark.parametrize("bits", [4, 8])
def test_prefill_rows_go_through_the_dequantized_float_gemm(bits, monkeypatch):
    """From DEQUANT_MIN_ROWS rows on, quant_linear dequantizes once and calls the float GEMM; the product equals the
    twin within float16 rounding, with bias and act-order permutation."""
    import rooflm.kernels.quant_gemm as qg
    from rooflm.kernels.quant_dequant import DEQUANT_MIN_ROWS

    calls = []
    real = qg.dequant_linear
    monkeypatch.setattr(qg, "dequant_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    pw = make_packed(1029, 4096, bits, 128, mins=bits == 4, perm=bits == 4, dtype=torch.float16, device="cuda")
    check(DEQUANT_MIN_ROWS, pw, torch.float16, "cuda", bias=True)
    check(DEQUANT_MIN_ROWS - 1, pw, torch.float16, "cuda", bias=True)
    assert len(calls) == 1, "only the call with DEQUANT_MIN_ROWS rows takes the float GEMM"


@pytest.mark.parametrize("bits", [4, 8])
def test_silu_mul_epilogue_pick_and_capture(bits, monkeypatch):
    """gate_up with SiLU-and-mul in the word GEMV's epilogue, as decode runs it: timed once against the unfused pair
    (either may win; the fused kernel is checked either way: the activation of the same GEMV's sums, bit for bit),
    act-order permuted input, then captured in a CUDA graph and replayed on new inputs."""
    from dataclasses import replace

    import rooflm.kernels.quant_gemv as qv
    from rooflm.kernels.activation import silu_and_mul
    from rooflm.quantization.packed import quant_linear_reference

    monkeypatch.setattr(qv, "_silu_picked", {})
    half, k = 5504, 4096
    pw = make_packed(2 * half, k, bits, 128, mins=bits == 4, perm=bits == 4, dtype=torch.float16, device="cuda")
    bias = torch.randn(2 * half, device="cuda", dtype=torch.float16)
    x = torch.randn(1, k, device="cuda", dtype=torch.float16)
    cands = qv.gemv_candidates(2 * half, k, bits, 128, qv.device_sms(x))
    cfg = qv.pick_gemv_silu_mul(x, pw, bias)
    assert len(qv._silu_picked) == 1 and (cfg is None or cfg in cands)
    cfg = cfg or next(c for c in cands if c is not None and c.split_k == 1)  # the unfused pair won: check one anyway
    xg = x.index_select(1, pw.perm) if pw.perm is not None else x
    fused = qv.gemv_silu_mul(x, pw, bias, cfg)
    assert torch.equal(fused, silu_and_mul(qv.launch_gemv(xg, pw, bias, replace(cfg, split_k=1))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = qv.gemv_silu_mul(x, pw, bias, cfg)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        ref = quant_linear_reference(x.double(), pw, bias.double())
        ref = torch.nn.functional.silu(ref[:, :half]) * ref[:, half:]
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        assert rel < 4e-3, f"relative error {rel:.2e} after replay"


@pytest.mark.parametrize("method", ["w4a16", "w8a16"])
def test_one_row_decode_hands_the_norms_over_between_packed_projections(method, monkeypatch):
    """A small float16 Llama quantized at load (RTN): at one row o_proj and down_proj hand the residual add and
    the norm's statistic to gate_up_proj and the next qkv_proj through the word GEMV; the logits of a decode step
    match the reference path's (the dequantized weights in torch)."""
    import rooflm.kernels.handoff_gemv as hg
    from kernel_checks import tiny_llama
    from rooflm.attention.metadata_utils import allocate_kv_caches, build_attention_metadata
    from rooflm.layers.custom_op import select_ops
    from rooflm.quantization.apply import quantize_model
    from rooflm.quantization.config import QuantConfig

    model = tiny_llama("cuda", layers=3, seed=6, hidden=512, inter=1024, heads=8, kv_heads=4, vocab=128, std=0.05)
    quantize_model(model, QuantConfig(method=method))
    monkeypatch.setenv("ROOFLM_FUSED_GEMV", "on")  # handed over whatever the timing of these small shapes
    monkeypatch.setattr(hg, "_choices", {})
    import rooflm.kernels.quant_mlp as qm  # the pair of word GEMVs, not the fused MLP (test_gpu_quant_mlp.py)

    monkeypatch.setattr(qm, "candidates", lambda gate_up, down: [])
    monkeypatch.setattr(qm, "_layer_picked", {})
    calls = []
    monkeypatch.setattr(hg, "packed_add_sumsq", lambda *a, _f=hg.packed_add_sumsq, **k: calls.append(1) or _f(*a, **k))
    caches = allocate_kv_caches(3, 8, 16, 4, 64, torch.float16, "cuda")
    logits = []
    for m in ("triton", "native"):
        select_ops(model, m, "cuda")
        g = torch.Generator().manual_seed(0)
        done = 0
        for new in (5, 1, 1):
            calls.clear()
            meta, pos = build_attention_metadata([[0]], [done], [new], 16, "cuda")
            ids = torch.randint(0, 128, (new,), generator=g).cuda()
            with torch.no_grad():
                out = model.compute_logits(model(ids, pos, caches, meta))
            done += new
        logits.append(out.float())
        assert len(calls) == (5 if m == "triton" else 0)  # two a layer, none after the last down_proj
    torch.testing.assert_close(logits[0], logits[1], atol=3e-2, rtol=3e-2)
