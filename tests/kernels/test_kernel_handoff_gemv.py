"""The projections that hand the residual add and the next norm's statistic to each other (rooflm.kernels.
handoff_gemv): the residual stream bit-equal to the GEMV followed by the add + norm kernel, the consumer's products
against the one-pass norm GEMV and the float64 twin, the whole pair against the unfused three launches."""
import pytest
import torch


def _setup(n, k, n2, dtype, device, seed, bias):
    g = torch.Generator().manual_seed(seed)
    h = dict(dtype=dtype)
    x = torch.randn(1, k, generator=g).to(**h)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(**h)
    res = torch.randn(1, n, generator=g).to(**h)
    nw = (1 + 0.1 * torch.randn(n, generator=g)).to(**h)
    w2 = (torch.randn(n2, n, generator=g) * n ** -0.5).to(**h)
    b = (0.1 * torch.randn(n, generator=g)).to(**h) if bias else None
    b2 = (0.1 * torch.randn(n2, generator=g)).to(**h) if bias else None
    return [t.to(device) if t is not None else None for t in (x, w, res, nw, w2, b, b2)]


@pytest.mark.parametrize("n,k", [(64, 256), (50, 200)])  # even and ragged tiles
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_producer_residual_bit_equal_to_unfused(device, n, k, bias, dtype):
    from rooflm.kernels.gemv import GemvConfig, gemv
    from rooflm.kernels.handoff_gemv import gemv_add_sumsq, gemv_add_sumsq_ref
    from rooflm.kernels.rmsnorm import rms_norm

    cfg = GemvConfig(False, 16, 64)
    x, w, res, nw, _, b, _ = _setup(n, k, 8, dtype, device, n + k, bias)
    y, h, ss = gemv_add_sumsq(x, w, b, cfg, res, nw)
    _, res_unfused = rms_norm(gemv(x, w, b, cfg), nw, 1e-5, res)  # the same tile's GEMV, then add + norm
    assert torch.equal(h, res_unfused)
    if dtype == torch.float16:
        assert torch.equal(y, (h.float() * nw.float()).to(dtype))
    else:  # within one bfloat16 rounding (Triton's interpreter may truncate where torch rounds to nearest)
        torch.testing.assert_close(y.float(), h.float() * nw.float(), rtol=2 ** -7, atol=0)
    assert ss.shape == ((n + 15) // 16,) and ss.dtype == torch.float32
    y_ref, h_ref, ss_ref = gemv_add_sumsq_ref(x, w, b, res, nw)
    torch.testing.assert_close(h.float(), h_ref.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(ss.sum().reshape(1), h.float().pow(2).sum().reshape(1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ss.sum().reshape(1), ss_ref, rtol=3e-2, atol=1e-2)


@pytest.mark.parametrize("n,n2", [(256, 64), (200, 50)])
@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_consumer_matches_one_pass_norm_and_twin(device, n, n2, silu_mul, bias):
    from rooflm.kernels.fused_gemv import rmsnorm_gemv
    from rooflm.kernels.gemv import GemvConfig
    from rooflm.kernels.handoff_gemv import rmsnorm_sumsq_gemv, rmsnorm_sumsq_gemv_ref

    cfg = GemvConfig(False, 16, 64)
    _, _, h, nw, w2, _, b2 = _setup(n, 32, n2, torch.float16, device, n + n2, bias)
    h = h * 3
    y = (h.float() * nw.float()).half()
    parts = h.float().pow(2).reshape(-1)  # partial sums in any split: here one per element
    out = rmsnorm_sumsq_gemv(y, parts, 1e-5, w2, b2, cfg, silu_mul)
    assert out.shape == (1, n2 // 2 if silu_mul else n2)
    # the one-pass norm GEMV: the same sums but of h * norm_weight in float32, its own statistic
    one_pass, _ = rmsnorm_gemv(h, nw, 1e-5, w2, b2, cfg, None, one_pass=True, silu_mul=silu_mul)
    torch.testing.assert_close(out.float(), one_pass.float(), rtol=5e-3, atol=5e-3)
    ref = rmsnorm_sumsq_gemv_ref(h.double(), nw.double(), 1e-5, w2.double(),
                                 b2.double() if b2 is not None else None, silu_mul)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    # a statistic off by 4x halves every output: the consumer really reads the partial sums
    quarter = rmsnorm_sumsq_gemv(y, parts * 4, 1e-5, w2, None, cfg)
    plain = rmsnorm_sumsq_gemv(y, parts, 1e-5, w2, None, cfg)
    torch.testing.assert_close(quarter.float() * 2, plain.float(), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("silu_mul", [False, True])
def test_pair_matches_unfused_three_launches(device, silu_mul):
    from rooflm.kernels.gemv import GemvConfig, gemv
    from rooflm.kernels.handoff_gemv import gemv_add_sumsq, rmsnorm_sumsq_gemv
    from rooflm.kernels.rmsnorm import rms_norm

    cfg = GemvConfig(False, 16, 64)
    x, w, res, nw, w2, b, b2 = _setup(96, 128, 48, torch.float16, device, 7, True)
    y, h, ss = gemv_add_sumsq(x, w, b, cfg, res, nw)
    out = rmsnorm_sumsq_gemv(y, ss, 1e-6, w2, b2, cfg, silu_mul)
    normed, res_new = rms_norm(gemv(x, w, b, cfg), nw, 1e-6, res)
    unfused = gemv(normed, w2, b2, cfg)
    if silu_mul:
        from rooflm.kernels.activation import silu_and_mul_ref

        unfused = silu_and_mul_ref(unfused)
    assert torch.equal(h, res_new)
    torch.testing.assert_close(out.float(), unfused.float(), rtol=1e-2, atol=1e-2)


def test_handoff_rejects_bad_inputs(device):
    from rooflm.kernels.gemv import GemvConfig
    from rooflm.kernels.handoff_gemv import gemv_add_sumsq, rmsnorm_sumsq_gemv

    h = dict(dtype=torch.float16, device=device)
    cfg = GemvConfig(False, 16, 32)
    w, nw = torch.randn(16, 32, **h), torch.ones(16, **h)
    with pytest.raises(ValueError, match=r"x must be one contiguous row \[1, 32\]"):
        gemv_add_sumsq(torch.randn(2, 32, **h), w, None, cfg, torch.randn(1, 16, **h), nw)
    with pytest.raises(ValueError, match="residual"):
        gemv_add_sumsq(torch.randn(1, 32, **h), w, None, cfg, torch.randn(1, 17, **h), nw)
    with pytest.raises(ValueError, match="norm_weight"):
        gemv_add_sumsq(torch.randn(1, 32, **h), w, None, cfg, torch.randn(1, 16, **h), torch.ones(32, **h))
    with pytest.raises(ValueError, match="split-K"):
        gemv_add_sumsq(torch.randn(1, 32, **h), w, None, GemvConfig(False, 16, 32, 2), torch.randn(1, 16, **h), nw)
    with pytest.raises(ValueError, match="split-K"):
        rmsnorm_sumsq_gemv(torch.randn(1, 32, **h), torch.ones(4, device=device), 1e-6, w, None,
                           GemvConfig(True, 16, 32))
    with pytest.raises(ValueError, match="sumsq"):
        rmsnorm_sumsq_gemv(torch.randn(1, 32, **h), torch.ones(4, **h), 1e-6, w, None, cfg)
    with pytest.raises(ValueError, match="does not fit"):
        rmsnorm_sumsq_gemv(torch.randn(1, 31, **h), torch.ones(4, device=device), 1e-6, w, None, cfg)
    with pytest.raises(ValueError, match=r"y must be one contiguous row"):
        rmsnorm_sumsq_gemv(torch.randn(2, 32, **h), torch.ones(4, device=device), 1e-6, w, None, cfg)


def test_pick_handoff_declines_what_it_cannot_run(device, monkeypatch):
    from rooflm.kernels.handoff_gemv import pick_handoff

    monkeypatch.setenv("ROOFLM_FUSED_GEMV", "on")  # on CUDA: no timing decides whether a pick comes back

    h = dict(dtype=torch.float16, device=device)
    x, w, w2 = torch.randn(1, 32, **h), torch.randn(16, 32, **h), torch.randn(8, 16, **h)
    assert pick_handoff(torch.randn(2, 32, **h), w, None, w2, None, 1e-6, False) is None  # two rows
    assert pick_handoff(x.float(), w, None, w2, None, 1e-6, False) is None  # another dtype
    assert pick_handoff(x, w, None, torch.randn(8, 15, **h), None, 1e-6, False) is None  # consumer width
    assert pick_handoff(x, w, None, torch.randn(7, 16, **h), None, 1e-6, True) is None  # odd [gate | up]
    assert pick_handoff(x, w, None, w2, None, 1e-6, False) is not None  # interpreter: small tiles


@pytest.mark.parametrize("layers", [1, 3])
def test_a_one_row_decode_step_hands_the_norms_over(device, layers, monkeypatch):
    """A tiny float16 Llama on the Triton path: at one row o_proj hands its add to gate_up_proj (with the norm and
    SiLU-and-mul) in every layer, and down_proj to the next layer's qkv_proj (not after the last layer, whose output
    goes to the model's norm); at two rows nothing is handed over. Logits match the reference selection."""
    import rooflm.kernels.handoff_gemv as hg
    from kernel_checks import tiny_llama
    from rooflm.attention.metadata_utils import allocate_kv_caches, build_attention_metadata
    from rooflm.layers.custom_op import select_ops

    model = tiny_llama(device, layers=layers, seed=5)
    # each layer knows the next one's norm and qkv_proj without a second module name for them
    assert not any("next_norm_qkv" in n for n, _ in model.named_modules(remove_duplicate=False))
    assert [bool(layer.next_norm_qkv) for layer in model.model.layers] == [True] * (layers - 1) + [False]
    calls = {"add": 0, "norm": 0}

    def spy(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setenv("ROOFLM_FUSED_GEMV", "on")  # on a GPU: handed over whatever the timing of these tiny shapes
    monkeypatch.setattr(hg, "_choices", {})
    monkeypatch.setattr(hg, "gemv_add_sumsq", spy("add", hg.gemv_add_sumsq))
    monkeypatch.setattr(hg, "rmsnorm_sumsq_gemv", spy("norm", hg.rmsnorm_sumsq_gemv))
    for seqs in (1, 2):
        caches = allocate_kv_caches(layers, 8, 4, 2, 16, torch.float16, device)
        tables = [[i] for i in range(seqs)]
        logits, counted = [], []
        for m in (None, "native"):
            select_ops(model, m or "triton", device)
            g = torch.Generator().manual_seed(seqs)
            done = [0] * seqs
            for new in ([2] * seqs, [1] * seqs, [1] * seqs):  # a short prefill, two decode steps
                calls.update(add=0, norm=0)
                meta, pos = build_attention_metadata(tables, done, new, 4, device)
                ids = torch.randint(0, 96, (sum(new),), generator=g).to(device)
                with torch.no_grad():
                    out = model.compute_logits(model(ids, pos, caches, meta))
                done = [d + n for d, n in zip(done, new)]
                counted.append(dict(calls))
            logits.append(out)
        decode = 2 * layers - 1 if seqs == 1 else 0
        # Triton path; on a GPU the first decode step also times the candidates through the same functions
        assert counted[0] == {"add": 0, "norm": 0} and counted[2] == {"add": decode, "norm": decode}
        assert counted[3:] == [{"add": 0, "norm": 0}] * 3  # the reference path never hands over
        torch.testing.assert_close(logits[0], logits[1], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("split", [1, 3])  # unsplit: the GEMV's epilogue; split: the split-K reduction's
@pytest.mark.parametrize("perm", [False, True])
def test_packed_producer_equals_word_gemv_then_add_norm(device, bits, split, perm):
    """The word GEMV's handoff epilogue: the residual stream bit-equal to the same configuration's GEMV followed by
    the add + norm kernel, y = h * norm_weight, one partial sum of squares per block of rows (also when K is split)."""
    from test_quant_gemm import make_packed

    from rooflm.kernels.handoff_gemv import packed_add_sumsq
    from rooflm.kernels.quant_gemv import QuantGemvConfig, launch_gemv
    from rooflm.kernels.rmsnorm import rms_norm

    n, k = 72, 512
    pw = make_packed(n, k, bits, 128, mins=bits == 4, perm=perm, dtype=torch.float16, device=device, seed=bits)
    cfg = QuantGemvConfig(16, 16, split)
    g = torch.Generator().manual_seed(split)
    x, res = (torch.randn(1, w, generator=g).half().to(device) for w in (k, n))
    nw = (1 + 0.1 * torch.randn(n, generator=g)).half().to(device)
    b = (0.1 * torch.randn(n, generator=g)).half().to(device)
    y, h, ss = packed_add_sumsq(x, pw, b, cfg, res, nw)
    xg = x.index_select(1, pw.perm) if perm else x
    _, want = rms_norm(launch_gemv(xg, pw, b, cfg), nw, 1e-5, res)
    assert torch.equal(h, want)
    assert torch.equal(y, (h.float() * nw.float()).half())
    assert ss.shape == ((n + 15) // 16,)
    torch.testing.assert_close(ss.sum(), h.float().pow(2).sum(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("split", [1, 2])
def test_packed_consumer_against_twin(device, bits, silu_mul, split):
    """The word GEMV scaled by 1/rms from partial sums: equal to the same GEMV of h * norm_weight times 1/rms (to
    float32 rounding), and near the float64 twin (reference norm of h, then the dequantized weight)."""
    from test_quant_gemm import make_packed

    from rooflm.kernels.activation import silu_and_mul_ref
    from rooflm.kernels.handoff_gemv import packed_rmsnorm_sumsq_gemv
    from rooflm.kernels.quant_gemv import QuantGemvConfig, launch_gemv
    from rooflm.kernels.rmsnorm import rms_norm_ref
    from rooflm.quantization.packed import quant_linear_reference

    k, n = 256, 48
    pw = make_packed(n, k, bits, 64, mins=bits == 4, perm=False, dtype=torch.float16, device=device, seed=3)
    cfg = QuantGemvConfig(8, 16, 1 if silu_mul else split)
    g = torch.Generator().manual_seed(bits)
    h = (2 * torch.randn(1, k, generator=g)).half().to(device)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).half().to(device)
    y = (h.float() * nw.float()).half()
    parts = h.float().pow(2).reshape(4, -1).sum(1)  # four partial sums
    out = packed_rmsnorm_sumsq_gemv(y, parts, 1e-5, pw, None, cfg, silu_mul)
    rstd = torch.rsqrt(h.float().pow(2).mean() + 1e-5)
    plain = launch_gemv(y, pw, None, QuantGemvConfig(8, 16, 1)).float() * rstd
    want = silu_and_mul_ref(plain.half()).float() if silu_mul else plain
    torch.testing.assert_close(out.float(), want, rtol=2e-3, atol=2e-3)
    ref = quant_linear_reference(rms_norm_ref(h.double(), nw.double(), 1e-5), pw, None)
    ref = silu_and_mul_ref(ref) if silu_mul else ref
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < 5e-3, rel


def test_pick_handoff_packed_declines_what_it_cannot_run(device, monkeypatch):
    from test_quant_gemm import make_packed

    from rooflm.kernels.handoff_gemv import pick_handoff_packed

    monkeypatch.setenv("ROOFLM_FUSED_GEMV", "on")  # on CUDA: no timing decides whether a pick comes back
    h = dict(dtype=torch.float16, device=device)
    p = make_packed(64, 256, 4, 128, mins=True, perm=False, dtype=torch.float16, device=device)
    c = make_packed(32, 64, 4, 64, mins=True, perm=False, dtype=torch.float16, device=device)
    x = torch.randn(1, 256, **h)
    pick = pick_handoff_packed(x, p, None, c, None, 1e-6, True)
    assert pick is not None and pick[1].block_n >= 2
    assert pick_handoff_packed(torch.randn(2, 256, **h), p, None, c, None, 1e-6, False) is None  # two rows
    assert pick_handoff_packed(x.float(), p, None, c, None, 1e-6, False) is None  # float32 activations
    assert pick_handoff_packed(x, p, None, p, None, 1e-6, False) is None  # consumer width != producer rows
    monkeypatch.setenv("ROOFLM_FUSED_GEMV", "off")
    monkeypatch.setattr("rooflm.kernels.handoff_gemv._choices", {})
    assert pick_handoff_packed(x, p, None, c, None, 1e-6, False) is None


def test_decode_launches_around_attention_with_programmatic_dependent_launch(device, monkeypatch):
    """Where the attention backend launches decode attention with programmatic dependent launch, the one-row decode
    step asks the handed-over qkv_proj (every layer after the first) to wait in place and let it start early, o_proj
    (every layer) to wait in place and let gate_up_proj start early, gate_up_proj to wait and let down_proj in after
    its main loop, and down_proj to wait and let the next qkv_proj in after its main loop; qkv_proj, o_proj and
    gate_up_proj load their first weight tile before they wait. The logits are the same bits as without it (on a
    Hopper GPU the launches change; elsewhere the flags are dropped at the launch)."""
    import rooflm.kernels.handoff_gemv as hg
    from kernel_checks import tiny_llama
    from rooflm.attention.metadata_utils import allocate_kv_caches, build_attention_metadata
    from rooflm.kernels._utils import TRIGGER_LATE, TRIGGER_START
    from rooflm.layers.custom_op import select_ops

    layers = 3
    model = tiny_llama(device, layers=layers, seed=6, heads=4, kv_heads=4)  # MHA: the fused decode attention
    calls = []

    def spy(name, fn):
        def wrapped(*a, **k):
            calls.append((name, k.get("silu_mul", False), k.get("pdl_trigger", 0), k.get("pdl_wait", False),
                          k.get("pdl_preload", False)))
            return fn(*a, **k)
        return wrapped

    monkeypatch.setenv("ROOFLM_FUSED_GEMV", "on")
    monkeypatch.setattr(hg, "_choices", {})
    monkeypatch.setattr(hg, "gemv_add_sumsq", spy("add", hg.gemv_add_sumsq))
    monkeypatch.setattr(hg, "rmsnorm_sumsq_gemv", spy("norm", hg.rmsnorm_sumsq_gemv))
    logits = {}
    for pdl in (False, True):
        select_ops(model, "triton", device)
        model.model.layers[0].self_attn.attn.backend.programmatic_launch = pdl  # one backend for every layer
        caches = allocate_kv_caches(layers, 8, 4, 4, 16, torch.float16, device)
        g = torch.Generator().manual_seed(1)
        done, out = [0], []
        for new in ([3], [1], [1]):  # a prefill, two decode steps
            calls.clear()
            meta, pos = build_attention_metadata([[0, 1]], done, new, 4, device)
            ids = torch.randint(0, 96, (sum(new),), generator=g).to(device)
            with torch.no_grad():
                out.append(model.compute_logits(model(ids, pos, caches, meta)))
            done = [done[0] + new[0]]
        logits[pdl] = out
        # the last decode step (the first also timed candidates on a GPU): per layer o_proj's add, gate_up's norm,
        # then down_proj's add and the next layer's qkv norm (not after the last layer)
        expect = []
        start, late = (TRIGGER_START, TRIGGER_LATE) if pdl else (0, 0)
        for i in range(layers):
            if i:
                expect.append(("norm", False, start, pdl, pdl))  # qkv_proj: lets decode attention start early
            # o_proj lets gate_up_proj in at its start, gate_up_proj lets down_proj in after its loop
            expect += [("add", False, start, pdl, pdl), ("norm", True, late, pdl, pdl)]
            if i < layers - 1:
                expect.append(("add", False, late, pdl, False))  # down_proj: the next qkv_proj after its loop
        assert calls == expect
    for a, b in zip(logits[False], logits[True]):
        assert torch.equal(a, b)


def test_preload_config_widens_narrow_row_tiles_within_the_budget():
    """After decode attention o_proj loads its first tile before it waits: a tile PRELOAD_BLOCK_K wide where that
    divides K, is wider than the pick and keeps at most 8192 products a program; the pick otherwise."""
    from rooflm.kernels.gemv import GemvConfig
    from rooflm.kernels.handoff_gemv import PRELOAD_BLOCK_K, preload_config

    assert PRELOAD_BLOCK_K == 2048
    assert preload_config(GemvConfig(False, 4, 1024, 1, 4, 2), 4096) == GemvConfig(False, 4, 2048, 1, 4, 2)
    assert preload_config(GemvConfig(False, 2, 512, 1, 8, 3), 6144) == GemvConfig(False, 2, 2048, 1, 8, 3)
    for cfg, k in [(GemvConfig(False, 4, 1024), 5120),  # 2048 does not divide K
                   (GemvConfig(False, 8, 512), 4096),  # 8 x 2048 products: over the budget
                   (GemvConfig(False, 2, 4096), 8192),  # already as wide
                   (GemvConfig(True, 4, 128), 4096), (GemvConfig(False, 4, 1024, 2), 4096)]:  # tl.dot, split-K
        assert preload_config(cfg, k) is cfg


def test_producer_takes_the_preload_tile_only_where_it_preloads(device, monkeypatch):
    """gemv_add_sumsq widens the tile (``preload_config``) only for a preloading launch that the GPU can make: with
    programmatic dependent launch unavailable, or without the preload, the picked tile runs. The wide tile's results
    are those of the same tile launched plainly."""
    import rooflm.kernels.handoff_gemv as hg
    from rooflm.kernels.gemv import GemvConfig

    g = torch.Generator().manual_seed(3)
    x, res = (torch.randn(1, n, generator=g).half().to(device) for n in (2048, 8))
    w = (torch.randn(8, 2048, generator=g) / 45).half().to(device)
    nw = torch.randn(8, generator=g).half().to(device)
    narrow, wide = GemvConfig(False, 4, 1024, 1, 4, 2), GemvConfig(False, 4, 2048, 1, 4, 2)
    tiles = []

    def spy(*a, **k):
        tiles.append(a[4])
        return launch(*a, **k)
    launch = hg.launch_gemv
    monkeypatch.setattr(hg, "launch_gemv", spy)
    for supported, preload, tile in [(False, True, narrow), (True, False, narrow), (True, True, wide)]:
        monkeypatch.setattr(hg, "pdl_supported", lambda _d, s=supported: s)
        out = hg.gemv_add_sumsq(x, w, None, narrow, res, nw, pdl_wait=True, pdl_preload=preload)
        assert tiles[-1] == tile
    plain = hg.gemv_add_sumsq(x, w, None, wide, res, nw)
    for a, b in zip(out, plain):
        assert torch.equal(a, b)


def test_decode_pdl_setting(monkeypatch):
    """``ROOFLM_DECODE_PDL``: on by default, 0 turns it off, anything else is refused with the variable's name."""
    from rooflm.attention.triton_backend import TritonAttention
    from rooflm.kernels._tl import decode_pdl_enabled

    monkeypatch.delenv("ROOFLM_DECODE_PDL", raising=False)
    assert decode_pdl_enabled() and TritonAttention().programmatic_launch
    monkeypatch.setenv("ROOFLM_DECODE_PDL", "0")
    assert not decode_pdl_enabled() and not TritonAttention().programmatic_launch
    monkeypatch.setenv("ROOFLM_DECODE_PDL", "yes")
    with pytest.raises(ValueError, match="ROOFLM_DECODE_PDL must be 0 or 1; got 'yes'"):
        TritonAttention()
