"""The native CPU matmul (``rooflm.kernels.cpu_native``): 4- and 8-bit grouped weights times activations quantized to
int8 per block of 32. Checked against a float reference of the same maths (weights dequantized exactly,
activations quantized the same way), against the plain float product, across the instruction-set paths it can be
compiled for, through its loader's fallbacks, and end to end on the default GGUF model."""
from __future__ import annotations

import itertools

import pytest
import torch

from rooflm.kernels import cpu_native
from rooflm.kernels.cpu_native import (
    NativeBuildError,
    load_library,
    native_linear,
    native_supports,
    pack_native,
    quantize_activations_reference,
)
from rooflm.kernels.cpu_native import build as native_build
from rooflm.kernels.cpu_quant import prepare_cpu, quant_linear_cpu
from rooflm.quantization.packed import PackedWeight, dequantize
from rooflm.quantization.rtn import quantize_rtn

# (instruction set forced, extra compiler flags): AVX512 machines run all three, AVX2 ones the last two
VARIANTS = {"native": (), "avx2": ("-mno-avx512f",), "scalar": ("-DQMM_FORCE_SCALAR",)}


@pytest.fixture(scope="module")
def lib():
    return load_library(native_build.default_flags())  # the build the CPU path uses


def _weight(bits: int, group: int, n: int, k: int, with_min: bool, seed: int, half: bool = False) -> PackedWeight:
    """``half``: scales and mins rounded to float16 first, as GGUF stores them (the kernel then keeps them so)."""
    gen = torch.Generator().manual_seed(seed)
    pw = quantize_rtn(torch.randn(n, k, generator=gen), bits, group, dtype=torch.float32)
    if with_min:  # a min per group, as GGUF Q4_1 / Q4_K / Q5_K and zero-point codes have
        pw.mins = torch.randn(n, k // group, generator=gen) * 0.05
    if half:
        pw.scales = pw.scales.half().float()
        pw.mins = None if pw.mins is None else pw.mins.half().float()
    return pw


def _same_maths(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    """The kernel's maths in float64: activations quantized per block of 32 as the kernel does, the weight
    dequantized exactly."""
    q, d = quantize_activations_reference(x)
    m, k = x.shape
    xq = (q.view(m, k // 32, 32).double() * d.double().unsqueeze(-1)).view(m, k)
    return xq @ dequantize(pw, dtype=torch.float64).T


FORMATS = [(4, 32, True), (4, 32, False), (4, 64, True), (4, 128, False), (8, 32, False), (8, 32, True),
           (8, 96, False)]


@pytest.mark.parametrize("bits,group,with_min", FORMATS)
@pytest.mark.parametrize("m", [1, 2, 5, 17])
@pytest.mark.parametrize("half", [False, True], ids=["f32-scales", "f16-scales"])
def test_matches_the_same_maths_in_float(lib, bits, group, with_min, m, half):
    n, k = 75, 384  # 75 rows: not a multiple of the rows a thread takes at a time; 12 blocks of 32
    pw = _weight(bits, group, n, k, with_min, seed=bits * 1000 + group + m, half=half)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    nw = pack_native(pw, lib)
    assert nw.scales.dtype == (torch.float16 if half else torch.float32)
    out = native_linear(x, nw)
    assert out.shape == (m, n) and out.dtype == torch.float32
    ref = _same_maths(x, pw)
    # float32 accumulation of exact integer block products: float rounding only
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("k", [96, 288])  # an odd number of 32-blocks (the layout pads to pairs)
def test_odd_block_count(lib, k):
    pw = _weight(4, 32, 40, k, True, seed=k)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(k))
    ref = _same_maths(x, pw)
    torch.testing.assert_close(native_linear(x, pack_native(pw, lib)).double(), ref, rtol=1e-5,
                               atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("bits", [4, 8])
def test_close_to_the_float_product(lib, bits):
    """Only the activations' 8-bit rounding separates the kernel from x @ W.T: about 0.5% relative."""
    pw = _weight(bits, 32, 64, 576, bits == 4, seed=bits)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(1))
    ref = x.double() @ dequantize(pw, dtype=torch.float64).T
    rel = ((native_linear(x, pack_native(pw, lib)).double() - ref).norm() / ref.norm()).item()
    assert 1e-4 < rel < 1.5e-2, rel


def test_zero_and_constant_rows(lib):
    pw = _weight(4, 32, 16, 64, True, seed=3)
    x = torch.zeros(2, 64)
    x[1] = 2.5
    out = native_linear(x, pack_native(pw, lib))
    torch.testing.assert_close(out[0], torch.zeros(16))
    torch.testing.assert_close(out.double(), _same_maths(x, pw), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["avx2", "scalar"])
def test_instruction_set_paths_agree(lib, tmp_path, monkeypatch, variant):
    """Each path the source can be compiled to gives the default build's result bit for bit: the same exact
    integer block products, then the same float operations in the same order. One row (the AVX2 path's own
    one-row kernel) and six (its tiles of several rows)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    other = load_library(VARIANTS[variant])
    if variant == "avx2" and native_build.isa_name(other) != "avx2":
        assert native_build.isa_name(lib) == native_build.isa_name(other)  # a machine without AVX2: both scalar
    for (bits, group, with_min), half, m in itertools.product(FORMATS, (False, True), (1, 6)):
        pw = _weight(bits, group, 33, 384, with_min, seed=group + bits, half=half)
        x = torch.randn(m, 384, generator=torch.Generator().manual_seed(group)) * 2
        a = native_linear(x, pack_native(pw, lib))
        b = native_linear(x, pack_native(pw, other))
        assert torch.equal(a, b), (bits, group, with_min, half, m, (a - b).abs().max().item())


def test_activation_codes_round_half_to_even_on_every_path(lib, tmp_path, monkeypatch):
    """Blocks whose max is 127, so x * 127 / max is x itself and every .5 is a tie: the vector quantizer rounds as
    the scalar one (to even) and as the reference; a wrong code moves the product by a whole weight column."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    scalar = load_library(VARIANTS["scalar"])
    ties = torch.tensor([127.0, -126.5, 2.5, -3.5, 0.5, -0.5, 1.5, -1.5] * 4)
    x = torch.stack([ties.repeat(12), (-ties).repeat(12), ties.roll(3).repeat(12)])  # [3, 384]
    q, _ = quantize_activations_reference(x)
    assert q[0, :8].tolist() == [127, -126, 2, -4, 0, 0, 2, -2]
    for bits in (4, 8):
        pw = _weight(bits, 32, 40, 384, bits == 4, seed=bits)
        for m in (1, 3):
            a = native_linear(x[:m], pack_native(pw, lib))
            assert torch.equal(a, native_linear(x[:m], pack_native(pw, scalar)))
            ref = _same_maths(x[:m], pw)
            torch.testing.assert_close(a.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("pool", ["default", "own-pool"])
def test_threads_split_the_rows_without_changing_the_result(lib, pool):
    """On torch's OpenMP threads (where torch uses libgomp) or the library's own pthread pool (a build without
    -fopenmp): every row is one thread's work, so the bits do not depend on the thread count."""
    pw = _weight(4, 32, 1000, 256, True, seed=5)
    nw = pack_native(pw, lib if pool == "default" else load_library())
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native_linear(x, nw)
        torch.set_num_threads(2)
        two = native_linear(x, nw)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each output row is computed by one thread, in the same order


def test_bad_input_is_refused(lib):
    pw = _weight(4, 16, 8, 48, False, seed=0)  # groups of 16, K = 48: not whole 32-blocks
    assert not native_supports(pw)
    with pytest.raises(ValueError, match="group_size=16"):
        pack_native(pw, lib)
    nw = pack_native(_weight(4, 32, 8, 64, False, seed=0), lib)
    with pytest.raises(ValueError, match=r"expected \[M, 64\]"):
        native_linear(torch.randn(2, 96), nw)
    with pytest.raises(ValueError, match="half=True"):
        pack_native(_weight(4, 32, 8, 64, False, seed=0), lib, half=True)  # RTN's float32 scales


def test_prepare_cpu_picks_the_native_kernel(lib, monkeypatch):
    monkeypatch.setenv("ROOFLM_CPU_NATIVE", "auto")
    pw = _weight(4, 64, 48, 128, True, seed=9)
    cw = prepare_cpu(pw)
    assert cw.kind == "native"
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(48, generator=torch.Generator().manual_seed(4))
    out = quant_linear_cpu(x.double(), cw, bias.double())
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, _same_maths(x, pw) + bias.double(), rtol=1e-5, atol=1e-4)
    q6 = _weight(8, 16, 48, 128, False, seed=9)  # GGUF Q6_K's groups of 16 stay on torch's kernels
    assert prepare_cpu(q6).kind == "dense"
    monkeypatch.setenv("ROOFLM_CPU_NATIVE", "off")
    assert prepare_cpu(pw).kind == "int4"


def test_missing_compiler_falls_back_or_raises(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # an empty cache: the library must be built
    monkeypatch.setenv("CC", "rooflm-no-such-compiler")
    native_build.reset_cache_state()
    try:
        with pytest.raises(NativeBuildError, match="rooflm-no-such-compiler"):
            load_library()
        monkeypatch.setenv("ROOFLM_CPU_NATIVE", "auto")
        with caplog.at_level("WARNING"):
            assert native_build.native_library() is None
            assert prepare_cpu(_weight(4, 32, 16, 64, False, seed=1)).kind == "int4"
        assert sum("unavailable" in r.message for r in caplog.records) == 1  # logged once
        monkeypatch.setenv("ROOFLM_CPU_NATIVE", "on")
        with pytest.raises(NativeBuildError):
            prepare_cpu(_weight(4, 32, 16, 64, False, seed=1))
    finally:
        native_build.reset_cache_state()


def test_failing_build_names_the_error(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native_build.reset_cache_state()
    try:
        with pytest.raises(NativeBuildError, match="failed"):
            load_library(("-DQMM_DOES_NOT_MATTER", "-fno-such-flag-for-rooflm"))
    finally:
        native_build.reset_cache_state()


def test_env_switch(monkeypatch):
    monkeypatch.setenv("ROOFLM_CPU_NATIVE", "off")
    assert native_build.native_library() is None
    assert prepare_cpu(_weight(4, 32, 16, 64, False, seed=1)).kind == "int4"
    monkeypatch.setenv("ROOFLM_CPU_NATIVE", "sometimes")
    with pytest.raises(ValueError, match="ROOFLM_CPU_NATIVE='sometimes'"):
        native_build.native_mode()


def test_build_is_cached_by_source_and_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    a = native_build.build_library(("-DQMM_FORCE_SCALAR",))
    assert a.parent == tmp_path / "rooflm" and a.exists()
    assert native_build.build_library(("-DQMM_FORCE_SCALAR",)) == a
    assert native_build.build_library(("-DQMM_FORCE_SCALAR", "-O2")) != a
    assert not [p for p in a.parent.iterdir() if p.name.startswith(".build-")]  # no temporary left behind
    assert cpu_native.isa_name(load_library(("-DQMM_FORCE_SCALAR",))) == "scalar"


def test_the_header_is_compiled_and_keys_the_cache(monkeypatch, tmp_path):
    """qmm.c includes qmm_tiles.h: an edit to the header alone makes a new library, and the header compiled is
    the one the package holds (copied beside the sources)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    flags = ("-DQMM_FORCE_SCALAR",)
    a = native_build.build_library(flags)
    texts = native_build._source_texts()
    assert len(texts) == len(native_build.SOURCES) + len(native_build.HEADERS)
    edited = [*texts[:-1], texts[-1] + b"\n/* an edit */\n"]
    monkeypatch.setattr(native_build, "_source_texts", lambda: edited)
    b = native_build.build_library(flags)
    assert b != a and b.exists()
    monkeypatch.setattr(native_build, "_source_texts", lambda: [*texts[:-1], b'#error "the packaged header"\n'])
    with pytest.raises(native_build.NativeBuildError, match="the packaged header"):
        native_build.build_library(flags)


@pytest.mark.parametrize("bits,with_min,half", [(4, True, True), (4, False, False), (8, False, True),
                                                 (8, True, False)])
def test_rows_do_not_depend_on_the_batch(lib, bits, with_min, half):
    """Each activation row is quantized on its own and each output is one thread's sum over blocks, so a row's
    result is the same bits whatever rows it is batched with (a speculative verify step scores what decoding
    would). On AVX2 a single row runs a kernel of its own (both halves of a group of 16 output rows in one pass)
    and several rows run tiles of up to four: these must agree too."""
    pw = _weight(bits, 32, 200, 576, with_min, seed=11 + bits, half=half)
    nw = pack_native(pw, lib)
    x = torch.randn(11, 576, generator=torch.Generator().manual_seed(11))
    full = native_linear(x, nw)
    for i in (0, 4, 10):
        assert torch.equal(native_linear(x[i:i + 1], nw)[0], full[i])
    assert torch.equal(native_linear(x[3:8], nw), full[3:8])


# ---------------------------------------------------------------------------------------------------------------------
# The default GGUF model (SmolLM2-135M: Q4_1 projections, Q8_0 tied LM head) end to end
# ---------------------------------------------------------------------------------------------------------------------
def _excerpt_perplexity(llm) -> float:
    from rooflm.bench.perplexity import excerpt_tokens, load_text, perplexity

    ids = excerpt_tokens(llm.get_tokenizer(), load_text(), 512)
    return perplexity(llm, ids, window=256).perplexity


@pytest.mark.slow
def test_default_model_perplexity_with_native_kernel(monkeypatch, default_model_path):
    from rooflm.llm import LLM

    results = {}
    for mode in ("off", "on"):
        monkeypatch.setenv("ROOFLM_CPU_NATIVE", mode)
        llm = LLM(default_model_path, device="cpu", max_model_len=257, max_num_batched_tokens=256,
                  enable_prefix_caching=False, show_progress=False)
        assert llm.engine.model.lm_head._cpu_weight.kind == ("native" if mode == "on" else "int4")
        results[mode] = _excerpt_perplexity(llm)
        del llm
    assert results["on"] != results["off"]  # the activations are rounded differently: not the same floats
    assert abs(results["on"] / results["off"] - 1) < 0.01, results


@pytest.mark.slow
def test_default_model_lean_and_module_paths_agree_with_native_kernel(monkeypatch, default_model_path):
    from rooflm.attention.metadata_utils import (
        allocate_kv_caches,
        build_attention_metadata,
    )
    from rooflm.loader import load_model

    monkeypatch.setenv("ROOFLM_CPU_NATIVE", "on")
    model, cfg = load_model(default_model_path, show_progress=False)
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj._cpu_weight.kind == "native"
    assert model.lm_head._cpu_weight.kind == "native" and model.lm_head._cpu_weight.native.bits == 8
    prompt = [504, 3458, 282, 260, 7140, 2986, 30, 1431, 315]

    def run(lean: str):
        monkeypatch.setenv("ROOFLM_CPU_LEAN", lean)
        caches = allocate_kv_caches(cfg.num_hidden_layers, 4, 16, cfg.num_key_value_heads, cfg.head_dim)
        done, new, ids, out = 0, len(prompt), list(prompt), []
        with torch.inference_mode():
            for _ in range(5):
                meta, positions = build_attention_metadata([[0, 1, 2, 3]], [done], [new], 16)
                logits = model.compute_logits(model(torch.tensor(ids), positions, caches, meta)[-1:])
                out.append(logits)
                ids = logits.argmax(-1).tolist()
                done, new = done + new, 1
        return out

    lean, plain = run("on"), run("off")
    for a, b in zip(lean, plain, strict=True):
        assert torch.equal(a, b)


def test_concurrent_builds_of_one_key_end_with_one_complete_library(monkeypatch, tmp_path):
    """Builders racing on an empty cache each compile to a private name and rename: every one returns the same
    path, and the file there loads."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    flags = ("-DQMM_FORCE_SCALAR", "-DQMM_RACE_TEST")
    with ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: native_build.build_library(flags), range(3)))
    assert len(set(paths)) == 1
    assert [p.name for p in (tmp_path / "rooflm").iterdir()] == [paths[0].name]
    native_build.reset_cache_state()
    try:
        assert native_build.isa_name(load_library(flags)) == "scalar"
    finally:
        native_build.reset_cache_state()


def test_native_library_answer_follows_the_variable(monkeypatch):
    """The kept answer of native_library is per raw value of ROOFLM_CPU_NATIVE: switching it takes effect at once."""
    monkeypatch.setenv("ROOFLM_CPU_NATIVE", "auto")
    lib = native_build.native_library()
    assert lib is not None and native_build.native_library() is lib
    monkeypatch.setenv("ROOFLM_CPU_NATIVE", "off")
    assert native_build.native_library() is None
    monkeypatch.setenv("ROOFLM_CPU_NATIVE", "sometimes")
    with pytest.raises(ValueError, match="ROOFLM_CPU_NATIVE='sometimes'"):
        native_build.native_library()
    monkeypatch.delenv("ROOFLM_CPU_NATIVE")
    assert native_build.native_library() is lib
