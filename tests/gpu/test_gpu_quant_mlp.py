"""The fused packed MLP (rooflm/kernels/quant_mlp.py) in a decode step on CUDA, beyond its kernel tests in
tests/kernels/test_quant_mlp.py (which also run here): the layer runs it between the handed-over norms, its logits
and greedy tokens match the pair of word GEMVs it replaces, and it replays from a CUDA graph."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

pytestmark = pytest.mark.gpu


def _decode(model, caches, steps: int, fused: bool, monkeypatch):
    """Greedy decode of a fixed prompt; (tokens, last logits, fused MLP launches a step)."""
    import rooflm.kernels.handoff_gemv as hg
    import rooflm.kernels.quant_mlp as qm
    from rooflm.attention.metadata_utils import build_attention_metadata

    monkeypatch.setattr(hg, "_choices", {})
    monkeypatch.setenv("ROOFLM_QUANT_MLP", "auto")
    monkeypatch.setattr(qm, "_layer_picked", {})
    monkeypatch.setattr(qm, "_picked", {})
    if not fused:
        monkeypatch.setattr(qm, "candidates", lambda gate_up, down: [])
    launches = []
    real = qm.fused_mlp
    monkeypatch.setattr(qm, "fused_mlp", lambda *a, **k: launches.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (6,), generator=g).cuda()
    done, tokens, counts = 0, [], []
    for _ in range(steps):
        launches.clear()
        meta, pos = build_attention_metadata([[0]], [done], [ids.numel()], 16, "cuda")
        with torch.no_grad():
            logits = model.compute_logits(model(ids, pos, caches, meta))
        done += ids.numel()
        ids = logits[-1:].argmax(-1)
        tokens.append(int(ids))
        counts.append(len(launches))
    monkeypatch.undo()
    return tokens, logits.float(), counts


@pytest.mark.parametrize("method", ["w4a16", "w8a16"])
def test_decode_step_runs_the_fused_mlp_and_keeps_the_tokens(method, monkeypatch):
    """A small float16 Llama quantized at load (RTN), one row: with the fused MLP forced on, every layer but the last
    (whose output goes to the model's norm) runs it; the greedy tokens equal the pair of word GEMVs' and the logits
    match within float16 rounding (its down sums are added in another order)."""
    from kernel_checks import tiny_llama
    from rooflm.attention.metadata_utils import allocate_kv_caches
    from rooflm.layers.custom_op import select_ops
    from rooflm.quantization.apply import quantize_model
    from rooflm.quantization.config import QuantConfig

    model = tiny_llama("cuda", layers=3, seed=6, hidden=512, inter=1024, heads=8, kv_heads=4, vocab=128, std=0.05)
    quantize_model(model, QuantConfig(method=method))
    select_ops(model, "triton", "cuda")
    runs = {}
    for fused in (True, False):
        monkeypatch.setenv("ROOFLM_FUSED_GEMV", "on")
        caches = allocate_kv_caches(3, 8, 16, 4, 64, torch.float16, "cuda")
        runs[fused] = _decode(model, caches, 6, fused, monkeypatch)
    tokens, logits, counts = runs[True]
    assert counts[0] == 0 and counts[1:] == [2] * 5  # prefill: none; decode: layers 0 and 1
    assert runs[False][2] == [0] * 6
    assert tokens == runs[False][0]
    torch.testing.assert_close(logits, runs[False][1], atol=2e-2, rtol=2e-2)


def test_fused_mlp_replays_in_a_cuda_graph():
    """Captured once, replayed on new inputs written in place: the same bits as an eager launch."""
    from test_quant_gemm import make_packed

    from rooflm.kernels.quant_mlp import FusedMlpConfig, fused_mlp

    gu = make_packed(2048, 512, 4, 128, True, False, torch.float16, "cuda", seed=1)
    dn = make_packed(512, 1024, 4, 128, True, False, torch.float16, "cuda", seed=2)
    cfg = FusedMlpConfig(32, 64, 128, 4, 1)
    x = torch.randn(1, 512, dtype=torch.float16, device="cuda")
    fused_mlp(x, gu, dn, cfg)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_mlp(x, gu, dn, cfg)
    for seed in range(3):
        x.copy_(torch.randn(1, 512, generator=torch.Generator().manual_seed(seed)).half())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fused_mlp(x, gu, dn, cfg))
