"""Programmatic dependent launch through a one-row decode layer (Hopper GPUs): the qkv projection lets the attention
kernel be scheduled while it drains, o_proj is launched while attention runs and waits in place, and so are
gate_up_proj, down_proj and the next layer's qkv_proj, each after the one before lets it in after its main loop
(o_proj, gate_up_proj and qkv_proj loading their first weight tile before they wait, float or packed). Lossless by
construction (every kernel waits for the one before it before it reads what that one writes); checked here bit for
bit against the same launches without it, eagerly and replayed from a CUDA graph, with float16 and packed 4- and
8-bit weights."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from test_quant_gemm import make_packed  # noqa: E402

from rooflm.kernels._tl import pdl_supported  # noqa: E402
from rooflm.kernels._utils import TRIGGER_LATE, TRIGGER_START  # noqa: E402
from rooflm.kernels.bench import decode_step_inputs  # noqa: E402
from rooflm.kernels.decode_attention import NewTokenKV, paged_decode_attention  # noqa: E402
from rooflm.kernels.gemv import GemvConfig  # noqa: E402

pytestmark = pytest.mark.gpu
H, HEADS, D, I = 2048, 16, 128, 1536


def _layer(packed: int):
    """One decode layer's qkv -> attention -> o -> gate_up -> down, then the next layer's qkv, as the model launches
    them at one row (the norms handed over); returns a function of pdl -> every output, and its inputs."""
    from rooflm.kernels import handoff_gemv as hg
    from rooflm.kernels.quant_gemv import QuantGemvConfig, default_gemv_config

    g = torch.Generator(device="cuda").manual_seed(packed)
    f16 = dict(dtype=torch.float16, device="cuda")
    caches, tables, seq_lens, _, new = decode_step_inputs(1, HEADS, HEADS, 1000, torch.float16, 1)
    y = torch.randn(1, H, generator=g, **f16)
    sumsq = torch.rand(8, generator=g, device="cuda") * H / 8
    res = torch.randn(1, H, generator=g, **f16)
    nw = 1 + 0.1 * torch.randn(H, generator=g, **f16)
    nw2 = 1 + 0.1 * torch.randn(H, generator=g, **f16)
    shapes = {"qkv": (3 * H, H), "o": (H, H), "gate_up": (2 * I, H), "down": (H, I)}
    if packed:
        w = {k: make_packed(n, kk, packed, 128, mins=packed == 4, perm=False, dtype=torch.float16, device="cuda")
             for k, (n, kk) in shapes.items()}
        cfg = {k: default_gemv_config(n, kk, packed, 128, 132) for k, (n, kk) in shapes.items()}
        # o_proj split over K (as the engine's 8-bit picks are), qkv_proj prefetching: each preloads its first tile
        cfg["o"] = QuantGemvConfig(16, 64, 2, 2, 3)
        cfg["qkv"] = QuantGemvConfig(16, 64, 1, 2, 3, prefetch=True)
        add_sumsq, norm_gemv = hg.packed_add_sumsq, hg.packed_rmsnorm_sumsq_gemv
    else:
        w = {k: torch.randn(n, kk, generator=g, **f16) * kk ** -0.5 for k, (n, kk) in shapes.items()}
        cfg = {k: GemvConfig(False, 16, 256) for k in shapes}
        cfg["o"] = hg.preload_config(GemvConfig(False, 4, 1024, 1, 4, 2), H)  # the engine's tile after attention
        assert cfg["o"].block_k == hg.PRELOAD_BLOCK_K
        add_sumsq, norm_gemv = hg.gemv_add_sumsq, hg.rmsnorm_sumsq_gemv

    def run(pdl: bool):
        start, late = (TRIGGER_START, TRIGGER_LATE) if pdl else (0, 0)
        p = {"pdl_preload": pdl}  # first weight tile loaded before the wait
        qkv = norm_gemv(y, sumsq, 1e-5, w["qkv"], None, cfg["qkv"], pdl_trigger=start)
        q, k, v = (t.view(1, HEADS, D) for t in qkv.split([H, H, H], dim=-1))
        a = paged_decode_attention(q, caches[0], tables, seq_lens, D ** -0.5, pdl=pdl,
                                   new_kv=NewTokenKV(k, v, new.cos, new.sin, new.slot_mapping))
        yo, h, ss = add_sumsq(a.view(1, H), w["o"], None, cfg["o"], res, nw, pdl_wait=pdl, pdl_trigger=start, **p)
        gu = norm_gemv(yo, ss, 1e-5, w["gate_up"], None, cfg["gate_up"], silu_mul=True, pdl_wait=pdl,
                       pdl_trigger=late, **p)
        yd, h2, ss2 = add_sumsq(gu, w["down"], None, cfg["down"], h, nw2, pdl_wait=pdl, pdl_trigger=late)
        qkv2 = norm_gemv(yd, ss2, 1e-5, w["qkv"], None, cfg["qkv"], pdl_trigger=start, pdl_wait=pdl, **p)
        return [qkv, a, yo, h, ss, gu, yd, h2, ss2, qkv2, caches[0]]
    return run, y


@pytest.mark.skipif(not pdl_supported(torch.device("cuda")), reason="programmatic dependent launch needs Hopper")
@pytest.mark.parametrize("packed", [0, 4, 8])
def test_pdl_decode_layer_bit_equal_eager_and_in_a_graph(packed):
    run, y = _layer(packed)
    ref = [t.clone() for t in run(False)]
    eager = run(True)
    for i, (a, b) in enumerate(zip(eager, ref)):
        assert torch.equal(a, b), f"output {i} differs with programmatic dependent launch (eager)"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run(True)
    for step in range(3):  # new inputs each replay: the results follow them
        y.copy_(torch.randn_like(y))
        graph.replay()
        torch.cuda.synchronize()
        ref = run(False)
        for i, (a, b) in enumerate(zip(outs, ref)):
            assert torch.equal(a, b), f"output {i} differs with programmatic dependent launch (replay {step})"


@pytest.mark.skipif(not pdl_supported(torch.device("cuda")), reason="programmatic dependent launch needs Hopper")
def test_pick_handoff_times_the_pair_as_the_model_launches_it(monkeypatch):
    """With a launch plan the pair's tiles are timed under it, kept apart from the plain pick, and o_proj (which loads
    its first tile before it waits for decode attention) gets a tile that ``preload_config`` widens; the launched
    pair computes what the reference does."""
    from rooflm.kernels import handoff_gemv as hg
    from rooflm.kernels._utils import DOWN_TO_QKV, O_TO_GATE_UP

    monkeypatch.setattr(hg, "_choices", {})
    g = torch.Generator(device="cuda").manual_seed(3)
    f16 = dict(dtype=torch.float16, device="cuda")
    x = torch.randn(1, H, generator=g, **f16)
    wo, wgu = (torch.randn(n, H, generator=g, **f16) * H ** -0.5 for n in (H, 2 * I))
    res, nw = torch.randn(1, H, generator=g, **f16), 1 + 0.1 * torch.randn(H, generator=g, **f16)
    hg.pick_handoff(x, wo, None, wgu, None, 1e-5, True)
    pick = hg.pick_handoff(x, wo, None, wgu, None, 1e-5, True, O_TO_GATE_UP)
    assert len(hg.choices()) == 2 and pick is not None
    assert hg.preload_config(pick[0], H) != pick[0]
    y, h, ss = hg.gemv_add_sumsq(x, wo, None, pick[0], res, nw, **O_TO_GATE_UP.producer())
    out = hg.rmsnorm_sumsq_gemv(y, ss, 1e-5, wgu, None, pick[1], silu_mul=True, **O_TO_GATE_UP.consumer())
    torch.cuda.synchronize()
    y_ref, h_ref, _ = hg.gemv_add_sumsq_ref(x, wo, None, res, nw)
    torch.testing.assert_close(h.float(), h_ref.float(), atol=2e-3, rtol=2e-3)
    ref = hg.rmsnorm_sumsq_gemv_ref(h_ref, nw, 1e-5, wgu, None, silu_mul=True)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
    wd = torch.randn(H, I, generator=g, **f16) * I ** -0.5  # down_proj -> qkv_proj: any row tile, timed so
    assert hg.pick_handoff(torch.randn(1, I, generator=g, **f16), wd, None, wgu[: 3 * H], None, 1e-5, False,
                           DOWN_TO_QKV) is not None


@pytest.mark.skipif(not pdl_supported(torch.device("cuda")), reason="programmatic dependent launch needs Hopper")
@pytest.mark.parametrize("bits", [4, 8])
def test_pick_handoff_packed_times_the_pair_as_the_model_launches_it(monkeypatch, bits):
    """Packed weights: with a launch plan the pair's word-GEMV tiles are timed under it over both halves'
    candidates at the widths in ``PLAN_TIMED_BITS`` (the pick kept apart from the plain one), elsewhere the plain
    pick stands; the launched pair computes what it does launched plainly (bit for bit) and what the norm kernel
    between the two GEMVs does (to float16 rounding)."""
    from rooflm.kernels import handoff_gemv as hg
    from rooflm.kernels._utils import O_TO_GATE_UP
    from rooflm.kernels.quant_gemv import gemv_silu_mul, launch_gemv
    from rooflm.kernels.rmsnorm import rms_norm

    monkeypatch.setattr(hg, "_choices", {})
    g = torch.Generator(device="cuda").manual_seed(bits)
    f16 = dict(dtype=torch.float16, device="cuda")
    wo, wgu = (make_packed(n, H, bits, 128, mins=bits == 4, perm=False, dtype=torch.float16, device="cuda")
               for n in (H, 2 * I))
    x = torch.randn(1, H, generator=g, **f16)
    res, nw = torch.randn(1, H, generator=g, **f16), 1 + 0.1 * torch.randn(H, generator=g, **f16)
    plain = hg.pick_handoff_packed(x, wo, None, wgu, None, 1e-5, True)
    pick = hg.pick_handoff_packed(x, wo, None, wgu, None, 1e-5, True, O_TO_GATE_UP)
    timed = bits in hg.PLAN_TIMED_BITS
    assert len(hg.choices()) == (2 if timed else 1)
    if not timed:
        assert pick == plain
    variants = hg._packed_variants(wo, wgu, True, torch.cuda.get_device_properties(0).multi_processor_count)
    assert len(variants) > 1 and all(v[1].split_k == 1 and v[1].block_n >= 2 for v in variants)
    if pick is None:  # unfused measured faster under the plan: nothing more to run
        assert plain is None or plain in variants
        return
    assert pick in variants or pick == plain
    outs = []
    for kw in (O_TO_GATE_UP, None):
        first = {"pdl_wait": True, "pdl_trigger": kw.producer_trigger} if kw else {}
        then = {"pdl_wait": True, "pdl_trigger": kw.consumer_trigger} if kw else {}
        y, h, ss = hg.packed_add_sumsq(x, wo, None, pick[0], res, nw, **first)
        outs.append((h, hg.packed_rmsnorm_sumsq_gemv(y, ss, 1e-5, wgu, None, pick[1], True, **then)))
    torch.cuda.synchronize()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    hn, h_ref = rms_norm(launch_gemv(x, wo, None, pick[0]), nw, 1e-5, res)
    assert torch.equal(outs[0][0], h_ref)
    ref = gemv_silu_mul(hn, wgu, None, pick[1])
    torch.testing.assert_close(outs[0][1].float(), ref.float(), atol=3e-2, rtol=3e-2)
