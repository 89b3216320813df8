"""The one-row word GEMV of 4- and 8-bit weights (rooflm/kernels/quant_gemv.py) against its twin,
``quant_linear_reference``: tiles of one group and of several, K split or not, N and K with ragged edges, mins and
bias, every activation dtype. On the CPU the kernel runs under Triton's interpreter (its float32 form); on CUDA the
same tests run its float16x2 form for float16 activations."""
from __future__ import annotations

import pytest
import torch

from test_quant_gemm import LIMIT, check, make_packed


def _gemv_check(pw, dtype, device, bias, cfg=None, seed=0, scale=1.0):
    """launch_gemv against the float64 twin on the same dequantized weight."""
    from rooflm.kernels.quant_gemv import launch_gemv
    from rooflm.quantization.packed import quant_linear_reference

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, pw.in_features, generator=g) * scale).to(dtype).to(device)
    b = torch.randn(pw.out_features, generator=g).to(dtype).to(device) if bias else None
    out = launch_gemv(x, pw, b, cfg)
    ref = quant_linear_reference(x.double(), pw, None if b is None else b.double())
    what = f"bits={pw.bits} group={pw.group_size} N={pw.out_features} K={pw.in_features} {dtype} {cfg} scale={scale}"
    assert out.shape == (1, pw.out_features) and out.dtype == dtype, what
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < LIMIT[dtype], f"{what}: relative error {rel:.2e}"


def _configs():
    from rooflm.kernels.quant_gemv import QuantGemvConfig

    return [None, QuantGemvConfig(16, 4, 3), QuantGemvConfig(32, 16, 1), QuantGemvConfig(8, 64, 2),
            QuantGemvConfig(16, 128, 1), QuantGemvConfig(16, 4, 3, prefetch=True),
            QuantGemvConfig(8, 16, 1, prefetch=True), QuantGemvConfig(16, 128, 1, prefetch=True),
            QuantGemvConfig(16, 128, 1, pair=True), QuantGemvConfig(8, 16, 2, prefetch=True, pair=True),
            QuantGemvConfig(16, 4, 3, pair=True), QuantGemvConfig(16, 16, 1, prefetch=2),
            QuantGemvConfig(8, 16, 3, prefetch=2, pair=True)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [16, 32, 64, 128, 256, "channel"])
def test_word_gemv_against_twin(device, bits, group):
    """Every tile shape against every group: a tile inside one group, a tile of several whole groups, a tile that
    runs past K (per channel, K = 192 or 4160 is no power of two); N odd; mins and bias alternate."""
    from rooflm.kernels.quant_gemv import tile_groups

    n, k = (37, 256) if device == "cpu" else (1029, 4096)
    if group == "channel":
        k = 192 if device == "cpu" else 4160
    gs = k if group == "channel" else group
    pw = make_packed(n, k, bits, gs, mins=bits == 4 or gs == 64, perm=False, dtype=torch.float16, device=device,
                     seed=bits)
    ran = 0
    for i, cfg in enumerate(_configs()):
        if cfg is not None and tile_groups(cfg.words, k, bits, gs) is None:
            continue
        _gemv_check(pw, torch.float16, device, bias=i % 2 == 1, cfg=cfg, seed=i)
        ran += 1
    assert ran >= 3, "most configurations must fit these groups"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits", [4, 8])
def test_word_gemv_dtypes(device, dtype, bits):
    pw = make_packed(24, 512, bits, 128, mins=True, perm=False, dtype=dtype, device=device, seed=bits)
    for cfg in _configs()[:3]:
        _gemv_check(pw, dtype, device, bias=True, cfg=cfg)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("scale", [100.0, 3000.0])
def test_word_gemv_large_activations(device, scale, bits):
    """Activations in the thousands (outlier features) stay finite and accurate: on CUDA the float16 products are
    formed with x / 16 (4 bits; x / 32 when two words share a sum) or x / 128 (8 bits) so that the few products a half
    sums cannot overflow below |x| = 16,000."""
    k = 512 if device == "cpu" else 4096
    pw = make_packed(40, k, bits, 128, mins=True, perm=False, dtype=torch.float16, device=device)
    _gemv_check(pw, torch.float16, device, bias=False, scale=scale)
    _gemv_check(pw, torch.float16, device, bias=True, scale=scale, cfg=_configs()[3])
    _gemv_check(pw, torch.float16, device, bias=False, scale=scale, cfg=_configs()[8])  # eight products a half


@pytest.mark.parametrize("bits", [4, 8])
def test_prefetch_depths_agree_bit_for_bit(device, bits):
    """Loading one or two tiles ahead changes only when the loads are issued, not the products or their order: the
    same bits as the loop that does not prefetch, for K of one, two and three whole tiles (the loads past the last
    tile repeat it), a ragged last tile, and K splits of one tile each; and each agrees with the float64 twin."""
    from rooflm.kernels.quant_gemv import QuantGemvConfig, launch_gemv

    words = 8 if bits == 4 else 16  # a tile is 64 columns; groups of 64 put one group in a tile
    for k in (64, 128, 192, 224):
        pw = make_packed(37, k, bits, 64 if k % 64 == 0 else k, mins=bits == 4, perm=False, dtype=torch.float16,
                         device=device, seed=k)
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)).to(torch.float16).to(device)
        for split, pair in ((1, False), (3, True)):
            outs = [launch_gemv(x, pw, None, QuantGemvConfig(16, words, split, 2, prefetch=d, pair=pair))
                    for d in (0, 1, 2)]
            what = f"bits={bits} K={k} split={split} pair={pair}"
            assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), what
        _gemv_check(pw, torch.float16, device, bias=True, cfg=QuantGemvConfig(16, words, 1, 2, prefetch=2), seed=k)


def test_prefetch_depth_is_checked():
    from rooflm.kernels.quant_gemv import QuantGemvConfig

    with pytest.raises(ValueError, match="prefetch=3"):
        QuantGemvConfig(16, 64, prefetch=3)
    for bad in (-1, 9, 1):  # the L2 is asked for tiles beyond those the registers prefetch, at most 8 ahead
        with pytest.raises(ValueError, match=f"l2_ahead={bad}"):
            QuantGemvConfig(16, 64, prefetch=True, l2_ahead=bad)


def test_l2_requests_leave_the_bits_alone(device):
    """Asking the L2 for tiles ahead (CUDA only; off under the interpreter, whose float32 form cannot run PTX) is a
    hint: every loop shape gives the same bits as without it, with the requests running past K and past N."""
    from rooflm.kernels.quant_gemv import QuantGemvConfig, launch_gemv

    k = 256 if device == "cpu" else 4160  # 4160: a ragged last tile of 64 words
    for bits in (4, 8):
        pw = make_packed(37, k, bits, k, mins=bits == 4, perm=False, dtype=torch.float16, device=device, seed=bits)
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(bits)).to(torch.float16).to(device)
        for pre, split, silu in ((0, 1, False), (1, 1, False), (2, 3, False), (1, 1, True)):
            if silu:
                pw = make_packed(74, k, bits, k, mins=False, perm=False, dtype=torch.float16, device=device, seed=5)
            plain = QuantGemvConfig(16, 16 if bits == 4 else 32, split, 2, prefetch=pre)
            ahead = QuantGemvConfig(16, 16 if bits == 4 else 32, split, 2, prefetch=pre, l2_ahead=3)
            a = launch_gemv(x, pw, None, plain, silu_mul=silu)
            b = launch_gemv(x, pw, None, ahead, silu_mul=silu)
            assert torch.equal(a, b), f"bits={bits} prefetch={pre} split={split} silu_mul={silu}"


def test_split_is_deterministic(device):
    from rooflm.kernels.quant_gemv import QuantGemvConfig, launch_gemv

    pw = make_packed(40, 1024, 4, 128, mins=True, perm=False, dtype=torch.float16, device=device)
    x = torch.randn(1, 1024).half().to(device)
    runs = [launch_gemv(x, pw, None, QuantGemvConfig(16, 16, 4)) for _ in range(2)]
    assert torch.equal(runs[0], runs[1]), "split-K must add its partial sums in a fixed order"


def test_quant_linear_sends_one_row_of_4_bit_codes_here(device, monkeypatch):
    """quant_linear's choice: one row of 4-bit codes goes to the word GEMV, anything else to the general kernel, and
    both answer the same product (within the float16 tolerance of the twin). The static choice: on CUDA the
    choice is otherwise timed, and a timing must not decide a test."""
    import rooflm.kernels.quant_gemm as qg
    import rooflm.kernels.quant_gemv as qv

    monkeypatch.setenv("ROOFLM_QUANT_GEMV", "default")
    monkeypatch.setattr(qv, "_gemv_picked", {})
    calls = []
    real = qg.launch_gemv
    monkeypatch.setattr(qg, "launch_gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    k = 256 if device == "cpu" else 4096
    pw4 = make_packed(37, k, 4, 64, mins=True, perm=True, dtype=torch.float16, device=device)
    pw8 = make_packed(37, k, 8, k, mins=False, perm=False, dtype=torch.float16, device=device)
    check(1, pw4, torch.float16, device, bias=True)
    assert len(calls) == 1, "one row of 4-bit codes (act-order permuted) must take the word GEMV"
    check(3, pw4, torch.float16, device, bias=True)
    check(1, pw8, torch.float16, device, bias=False)
    assert len(calls) == 1, "several rows, and 8-bit codes, stay on the general kernel"
    x = torch.randn(1, k).half().to(device)
    word = qg.quant_linear(x, pw4)
    general = qg.quant_linear(x, pw4, cfg=qg.default_config(1, 37, k, 4, 64, 132))
    torch.testing.assert_close(word, general, atol=2e-3, rtol=1e-2)


def test_groups_no_word_tile_fits_fall_back(device):
    """4-bit groups of 2 or 6 columns split a 32-bit word: no word tile fits, quant_linear takes the general kernel,
    and launch_gemv refuses with the group named."""
    from rooflm.kernels.quant_gemv import launch_gemv, supports

    pw = make_packed(16, 48, 4, 6, mins=True, perm=False, dtype=torch.float16, device=device)
    x = torch.randn(1, 48).half().to(device)
    assert not supports(x, pw)
    check(1, pw, torch.float16, device, bias=False)
    with pytest.raises(ValueError, match="group_size=6"):
        launch_gemv(x, pw, None)


def test_default_gemv_config_shapes():
    """The heuristic: 512 bytes of a row a tile at 4 bits and 16 rows a program; K split only for few rows and a
    long K (Llama-2-7B's down projection: 4096 rows, K = 11008)."""
    from rooflm.kernels.quant_gemv import QuantGemvConfig, default_gemv_config, tile_groups

    assert default_gemv_config(12288, 4096, 4, 128, 132) == QuantGemvConfig(16, 128, 1)
    assert default_gemv_config(4096, 4096, 4, 128, 132) == QuantGemvConfig(16, 128, 1)
    down = default_gemv_config(4096, 11008, 4, 128, 132)
    assert (down.block_n, down.words, down.split_k) == (16, 128, 3)
    assert tile_groups(128, 4096, 4, 128) == (8, 16)  # eight groups of 16 words a tile
    assert tile_groups(8, 4096, 4, 128) == (1, 8)  # a tile inside one group
    assert tile_groups(32, 4096, 4, 48) is None  # 6 words a group: a 32-word tile straddles groups
    assert default_gemv_config(16, 48, 4, 6, 132) is None
    with pytest.raises(ValueError, match="words=24"):
        QuantGemvConfig(16, 24)
    with pytest.raises(ValueError, match="split_k"):
        QuantGemvConfig(16, 16, 0)


def test_supports_agrees_with_the_tiles():
    """supports() decides from attributes alone; it must say yes exactly where a tile fits the groups."""
    from rooflm.kernels.quant_gemv import default_gemv_config, supports

    x = torch.zeros(1, 96, dtype=torch.float16)
    for group in (2, 4, 6, 8, 12, 16, 24, 32, 48, 96):
        pw = make_packed(8, 96, 4, group, mins=False, perm=False, dtype=torch.float16, device="cpu")
        assert supports(x, pw) == (default_gemv_config(8, 96, 4, group, 8) is not None), group
    pw = make_packed(8, 96, 4, 32, mins=False, perm=False, dtype=torch.float16, device="cpu")
    assert not supports(torch.zeros(2, 96, dtype=torch.float16), pw), "one row only"
    for group in (2, 4, 6, 32, 96):  # 8-bit codes: four a word
        pw = make_packed(8, 96, 8, group, mins=False, perm=False, dtype=torch.float16, device="cpu")
        assert supports(x, pw) == (group % 4 == 0 or group == 96), group


def test_pick_gemv_static_choice_off_cuda(monkeypatch):
    """Without CUDA (and with ROOFLM_QUANT_GEMV=default) nothing is timed: the word GEMV with the static tiles at 4
    bits, the general kernel (None) at 8; a bad ROOFLM_QUANT_GEMV is named."""
    import rooflm.kernels.quant_gemv as qv

    monkeypatch.setattr(qv, "_gemv_picked", {})
    monkeypatch.setattr(qv, "fastest", lambda *a, **kw: pytest.fail("timed off CUDA"))
    x = torch.zeros(1, 256, dtype=torch.float16)
    pw4 = make_packed(40, 256, 4, 64, mins=True, perm=False, dtype=torch.float16, device="cpu")
    pw8 = make_packed(40, 256, 8, 256, mins=False, perm=False, dtype=torch.float16, device="cpu")
    assert qv.pick_gemv(x, pw4, None) == qv.default_gemv_config(40, 256, 4, 64, qv.device_sms(x))
    assert qv.pick_gemv(x, pw8, None) is None
    got = qv.choices()
    assert got[next(k for k in got if k[2] == 8)] == "general"
    assert got[next(k for k in got if k[2] == 4)] == qv.short_name(qv.default_gemv_config(40, 256, 4, 64, 0))
    assert qv.short_name(qv.QuantGemvConfig(16, 64, 4, 2, prefetch=2, pair=True)) == "16x64w/s4/2wpp2"
    assert qv.short_name(qv.QuantGemvConfig(16, 64, 1, 2, prefetch=1, l2_ahead=4)) == "16x64w/2wpL4"
    monkeypatch.setattr(qv, "_gemv_picked", {})
    monkeypatch.setenv("ROOFLM_QUANT_GEMV", "fast")
    with pytest.raises(ValueError, match="ROOFLM_QUANT_GEMV='fast'"):
        qv.pick_gemv(x, pw4, None)


def test_wide_mode_offers_every_candidate_at_each_prefetch_depth(monkeypatch):
    """ROOFLM_QUANT_GEMV=wide: the same candidates, the static choice first, each at 0, 1 and 2 tiles ahead, with
    and without L2 requests 4 tiles ahead, once; ``wide=False`` (the handed-over pairs' list) ignores the mode."""
    from rooflm.kernels.quant_gemv import gemv_candidates

    for n, k, bits, group in ((12288, 4096, 4, 128), (4096, 11008, 8, 11008)):
        monkeypatch.delenv("ROOFLM_QUANT_GEMV", raising=False)
        auto = gemv_candidates(n, k, bits, group, 132)
        monkeypatch.setenv("ROOFLM_QUANT_GEMV", "wide")
        wide = gemv_candidates(n, k, bits, group, 132)
        assert wide[0] == auto[0] and len(set(wide)) == len(wide)
        tiles = {None if c is None else (c.block_n, c.words, c.split_k, c.num_warps, c.pair) for c in auto}
        assert {None if c is None else (c.block_n, c.words, c.split_k, c.num_warps, c.pair) for c in wide} == tiles
        words = [c for c in wide if c is not None]
        assert len(words) == 6 * len(tiles - {None}), (n, k, bits)
        assert {(int(c.prefetch), c.l2_ahead) for c in words} == {(d, a) for d in (0, 1, 2) for a in (0, 4)}
        assert gemv_candidates(n, k, bits, group, 132, wide=False) == auto


@pytest.mark.parametrize("bits", [4, 8])
def test_fastest_takes_the_smallest_time_and_every_candidate_runs(device, bits):
    """``fastest`` with a scripted timer: each candidate's call runs, the smallest time wins, ties go to the first
    (the static choice). The candidates' tiles fit the groups, and each computes the product (against the twin)."""
    from rooflm.kernels.quant_gemm import quant_linear
    from rooflm.kernels.quant_gemv import fastest, gemv_candidates, launch_gemv, tile_groups
    from rooflm.quantization.packed import quant_linear_reference

    n, k, group = (40, 256, 64) if device == "cpu" else (1029, 4096, 128)
    group = group if bits == 4 else k
    dtype = torch.float32 if device == "cpu" else torch.float16
    cands = gemv_candidates(n, k, bits, group, sms=8)
    assert len(cands) >= 3 and (cands[0] is None) == (bits == 8)
    assert all(c is None or tile_groups(c.words, k, bits, group) is not None for c in cands)
    pw = make_packed(n, k, bits, group, mins=bits == 4, perm=False, dtype=dtype, device=device, seed=bits)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    for winner in range(len(cands)):
        times = iter([2.0 if i != winner else 1.0 for i in range(len(cands))])
        calls = []

        def timer(call, weights, dev):
            calls.append(call(weights[0]).shape)
            return next(times)

        assert fastest(x, pw, None, cands, timer) is cands[winner]
        assert calls == [(1, n)] * len(cands)
    ties = iter([1.0] * len(cands))
    assert fastest(x, pw, None, cands, lambda call, w, d: next(ties)) is cands[0]
    ref = quant_linear_reference(x.double(), pw, None)
    for c in cands:
        got = quant_linear(x, pw) if c is None else launch_gemv(x, pw, None, c)
        assert ((got.double() - ref).norm() / ref.norm()).item() < LIMIT[dtype], c


@pytest.mark.parametrize("bits", [4, 8])
def test_silu_mul_epilogue_equals_gemv_then_activation(device, bits):
    """gate_up's word GEMV with SiLU-and-mul as its epilogue equals, bit for bit, the same configuration's GEMV
    followed by the activation kernel: ragged and even halves, mins and bias, one- and two-word products, the
    next tile loaded ahead; and it agrees with the float64 twin. A K split is ignored (one launch)."""
    from rooflm.kernels.activation import silu_and_mul
    from rooflm.kernels.quant_gemv import QuantGemvConfig, launch_gemv
    from rooflm.quantization.packed import quant_linear_reference

    k = 256 if device == "cpu" else 4096
    dtype = torch.float16
    cfgs = [QuantGemvConfig(16, 16), QuantGemvConfig(8, 32, 1, 2, prefetch=True), QuantGemvConfig(32, 16, pair=True),
            QuantGemvConfig(16, 16, 4)]
    for half, mins, bias in ((37, bits == 4, True), (64, False, False)):
        pw = make_packed(2 * half, k, bits, 64, mins=mins, perm=False, dtype=dtype, device=device, seed=half)
        g = torch.Generator().manual_seed(half)
        x = torch.randn(1, k, generator=g).to(dtype).to(device)
        b = torch.randn(2 * half, generator=g).to(dtype).to(device) if bias else None
        ref = quant_linear_reference(x.double(), pw, None if b is None else b.double())
        ref = torch.nn.functional.silu(ref[:, :half]) * ref[:, half:]
        for cfg in cfgs:
            fused = launch_gemv(x, pw, b, cfg, silu_mul=True)
            assert fused.shape == (1, half) and fused.dtype == dtype, cfg
            unfused = silu_and_mul(launch_gemv(x, pw, b, QuantGemvConfig(cfg.block_n, cfg.words, 1, cfg.num_warps,
                                                                         cfg.num_stages, cfg.asm, cfg.prefetch,
                                                                         cfg.pair)))
            assert torch.equal(fused, unfused), f"{cfg} half={half}: fused and unfused differ"
            rel = ((fused.double() - ref).norm() / ref.norm()).item()
            assert rel < 2 * LIMIT[dtype], f"{cfg} half={half}: relative error {rel:.2e}"


def test_silu_mul_epilogue_refuses_odd_rows_and_is_not_picked_off_cuda(monkeypatch):
    import rooflm.kernels.quant_gemv as qv

    pw = make_packed(37, 256, 4, 64, mins=True, perm=False, dtype=torch.float16, device="cpu")
    x = torch.zeros(1, 256, dtype=torch.float16)
    with pytest.raises(ValueError, match="even number of rows"):
        qv.launch_gemv(x, pw, None, qv.QuantGemvConfig(16, 16), silu_mul=True)
    monkeypatch.setattr(qv, "_silu_picked", {})
    pw = make_packed(38, 256, 4, 64, mins=True, perm=False, dtype=torch.float16, device="cpu")
    assert qv.pick_gemv_silu_mul(x, pw, None) is None, "nothing is timed without CUDA: the unfused pair runs"
    assert qv.pick_gemv_silu_mul(torch.zeros(2, 256, dtype=torch.float16), pw, None) is None, "one row only"
