"""Checks shared by tests/kernels (CPU, Triton interpreter, small shapes) and tests/gpu (CUDA, larger shapes).

Each check draws fresh random inputs, runs a kernel and its torch twin, and asserts they agree within the dtype's
tolerance. Outputs are poisoned (NaN) before the kernel runs where the kernel takes an ``out`` buffer, so an unwritten
element fails.
"""
from __future__ import annotations

import math

import torch

from rooflm.attention.kv_quant import qmax

TOL = {torch.float16: (2e-3, 1e-2), torch.bfloat16: (1.6e-2, 2e-2), torch.float32: (1e-4, 1e-4)}


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str, scale: float = 1.0) -> None:
    atol, rtol = TOL[dtype]
    assert not torch.isnan(out).any(), f"{what}: NaN in output"
    torch.testing.assert_close(out.float(), ref.float(), atol=atol * scale, rtol=rtol, msg=lambda m: f"{what}: {m}")


def quantize_cache(cache: torch.Tensor, kv_cache_dtype: str):
    """A QuantizedKVCache holding ``cache`` quantized ("int8" / "fp8"), or ``cache`` itself for "auto"."""
    from rooflm.attention.kv_quant import QuantizedKVCache, kv_storage_dtype, quantize_rows

    if kv_cache_dtype == "auto":
        return cache
    data, scales = quantize_rows(cache, kv_storage_dtype(kv_cache_dtype, cache.dtype))
    return QuantizedKVCache(data, scales)


def make_paged(
    lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, device: str,
    extra_blocks: int = 3, gen: torch.Generator | None = None, kv_cache_dtype: str = "auto",
):
    """A random KV cache (quantized unless ``kv_cache_dtype`` is "auto") and block tables whose blocks are scattered
    (a random permutation), padded with 0. Rows get magnitudes from 1e-3 to 10, so per-row scales matter."""
    need = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(need) + extra_blocks
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.randn(shape, generator=gen)
    if kv_cache_dtype != "auto":
        cache = cache * 10 ** (4 * torch.rand(shape[:-1], generator=gen)[..., None] - 3)
    cache = quantize_cache(cache.to(dtype).to(device), kv_cache_dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), max(need + [1]) + 1, dtype=torch.int32)
    i = 0
    for s, n in enumerate(need):
        tables[s, :n] = perm[i : i + n].to(torch.int32)
        i += n
    return cache, tables.to(device)


def check_decode(num_heads, num_kv_heads, head_dim, block_size, lens, window=None, num_splits=None,
                 dtype=torch.float16, device="cpu", seed=0, fused_reduce=False, block_n=None, kv_cache_dtype="auto",
                 use_dot=None):
    from rooflm.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref

    g = torch.Generator().manual_seed(seed)
    cache, tables = make_paged(lens, num_kv_heads, head_dim, block_size, dtype, device, gen=g,
                               kv_cache_dtype=kv_cache_dtype)
    q = torch.randn(len(lens), num_heads, head_dim, generator=g).to(dtype).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, cache, tables, seq_lens, scale, window, num_splits=num_splits, out=out,
                           fused_reduce=fused_reduce, block_n=block_n, use_dot=use_dot)
    ref = paged_decode_attention_ref(q, cache, tables, seq_lens, scale, window)
    assert_close(out, ref, dtype, f"decode H={num_heads} Hkv={num_kv_heads} D={head_dim} lens={lens} w={window} "
                                  f"kv={kv_cache_dtype}")


def make_step(ctx_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, gen,
              kv_cache_dtype="auto"):
    """Random q/k/v for one step whose sequences have ``ctx_lens`` cached tokens and ``q_lens`` new ones, plus the
    AttentionMetadata with slots pointing into each sequence's blocks."""
    from rooflm.attention.backend import AttentionMetadata

    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    cache, tables = make_paged(seq_lens, num_kv_heads, head_dim, block_size, dtype, device, gen=gen,
                               kv_cache_dtype=kv_cache_dtype)
    slots = []
    for i, (c, n) in enumerate(zip(ctx_lens, q_lens)):
        for p in range(c, c + n):
            slots.append(int(tables[i, p // block_size]) * block_size + p % block_size)
    T = sum(q_lens)
    q = torch.randn(T, num_heads, head_dim, generator=gen).to(dtype).to(device)
    # k/v as views of one fused buffer (strided in dim 0), the way a fused QKV projection hands them over
    kv = torch.randn(T, 2, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    k, v = kv[:, 0], kv[:, 1]
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    return q, k, v, cache, meta


def check_prefill(num_heads, num_kv_heads, head_dim, block_size, ctx_lens, q_lens, window=None,
                  dtype=torch.float16, device="cpu", seed=0, tiles=None, kv_cache_dtype="auto"):
    from rooflm.kernels.kv_cache import write_kv_cache
    from rooflm.kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref

    g = torch.Generator().manual_seed(seed)
    q, k, v, cache, meta = make_step(ctx_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, g,
                                     kv_cache_dtype)
    write_kv_cache(k, v, cache, meta.slot_mapping)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.max_query_len,
                            scale, window, out=out, tiles=tiles)
    ref = paged_prefill_attention_ref(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale, window)
    assert_close(out, ref, dtype, f"prefill H={num_heads} Hkv={num_kv_heads} ctx={ctx_lens} q={q_lens} w={window} "
                                  f"kv={kv_cache_dtype}")


def run_backend_and_reference(backend, q, k, v, cache, meta, scale: float, window, g: torch.Generator):
    """One attention step through ``backend`` and through TorchRefAttention, the protocol a model calls
    (rotary_and_write, then attend), with random rotary tables drawn from ``g``; the reference works on a clone of
    ``cache``. Returns (backend's rotated q, its output, the reference's rotated q, its output, the reference's
    cache)."""
    from rooflm.attention.torch_ref import TorchRefAttention

    head_dim = q.shape[-1]
    angles = 100 * torch.rand(q.shape[0], head_dim // 2, generator=g)  # per-token rows, as the model passes them
    cos, sin = angles.cos().to(q.dtype).to(q.device), angles.sin().to(q.dtype).to(q.device)
    cache_ref = cache.clone()
    ref_q, _ = TorchRefAttention().rotary_and_write(q.clone(), k.clone(), v.clone(), cos, sin, cache_ref, meta)
    ref = TorchRefAttention().attend(ref_q, cache_ref, meta, scale, window)
    rq, _ = backend.rotary_and_write(q, k, v, cos, sin, cache, meta)
    out = backend.attend(rq, cache, meta, scale, window)
    return rq, out, ref_q, ref, cache_ref


def check_backend(num_heads, num_kv_heads, head_dim, block_size, ctx_lens, q_lens, window=None,
                  dtype=torch.float16, device="cpu", seed=0, kv_cache_dtype="auto", backend_cls=None):
    """A backend (TritonAttention by default) against TorchRefAttention through the whole protocol a model calls
    (rotary_and_write, then attend): same rotated queries, same cache afterwards (cache slots not written must be
    untouched), same output. A quantized cache is compared dequantized, within one quantization step of the
    reference's values."""
    from rooflm.attention.torch_ref import TorchRefAttention

    if backend_cls is None:
        from rooflm.attention.triton_backend import TritonAttention as backend_cls

    g = torch.Generator().manual_seed(seed)
    q, k, v, cache, meta = make_step(ctx_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, g,
                                     kv_cache_dtype)
    scale = head_dim ** -0.5
    rq, out, ref_q, ref, cache_ref = run_backend_and_reference(backend_cls(), q, k, v, cache, meta, scale, window, g)
    assert_close(rq, ref_q, dtype, "backend rotated q")
    written = torch.zeros(cache.shape[1] * cache.shape[2], dtype=torch.bool, device=device)
    written[meta.slot_mapping] = True
    written = written.view(cache.shape[1], cache.shape[2])
    if kv_cache_dtype == "auto":
        assert torch.equal(cache[:, ~written], cache_ref[:, ~written]), "the backend changed slots it was not given"
        assert_close(cache[:, written], cache_ref[:, written], dtype, "backend cache write")
    else:
        assert torch.equal(cache.scales[:, ~written], cache_ref.scales[:, ~written]), "scales of other slots changed"
        assert torch.equal(cache.data.view(torch.uint8)[:, ~written], cache_ref.data.view(torch.uint8)[:, ~written])
        check_quantized_close(cache, cache_ref, written, "backend quantized cache write",
                              input_rel=2 * torch.finfo(dtype).eps)
        # attention on the very cache the kernel wrote: as close as without quantization
        same = TorchRefAttention().attend(rq, cache, meta, scale, window)
        assert_close(out, same, dtype, f"backend attend ctx={ctx_lens} q={q_lens} w={window} kv={kv_cache_dtype}")
        # end to end: a key one quantization step away (the kernel rotates in float32, the reference in 16-bit
        # arithmetic) moves an output row by ~1e-2 at these magnitudes, and by more where the softmax is peaked (seen
        # on an H100: one query row of 1300 off by 0.6). The attention itself was checked exactly above, so here the
        # typical row must agree and no more than 1% of the rows may differ beyond the quantized tolerance.
        atol, rtol = TOL[dtype]
        bad = ~torch.isclose(out.float(), ref.float(), atol=atol * 8, rtol=rtol).all(-1).all(-1)
        assert bad.float().mean().item() <= 0.01, f"backend kv={kv_cache_dtype}: {int(bad.sum())} rows differ"
        assert (out.float() - ref.float()).abs().median().item() <= atol, f"backend kv={kv_cache_dtype}: median"
        return
    assert_close(out, ref, dtype, f"backend ctx={ctx_lens} q={q_lens} w={window}")


def check_quantized_close(cache, ref, slots_mask=None, what="quantized cache", input_rel=0.0) -> None:
    """Two quantized caches written from nearly the same inputs: scales within float rounding of each other and
    dequantized values within one quantization step, plus ``input_rel`` times the row's largest element where the
    inputs themselves differ (the torch reference rotates keys in 16-bit arithmetic, the kernel in float32)."""
    sel = (lambda t: t[:, slots_mask]) if slots_mask is not None else (lambda t: t)
    s, sr = sel(cache.scales), sel(ref.scales)
    torch.testing.assert_close(s, sr, rtol=1e-5 + 2 * input_rel, atol=0, msg=lambda m: f"{what} scales: {m}")
    a, b = sel(cache.dequantize()), sel(ref.dequantize())
    scale = torch.maximum(s, sr)[..., None]
    if cache.dtype == torch.int8:
        step = scale
    else:  # one e4m3 step: 2^-3 of the value (3 mantissa bits), 2^-9 of the scale among the subnormals
        step = torch.maximum(a.abs(), b.abs()) / 8 + scale / 512
    step = step + input_rel * scale * qmax(cache.dtype)
    err = (a - b).abs()
    assert not torch.isnan(err).any(), f"{what}: NaN"
    assert (err <= step * 1.001 + 1e-7).all(), f"{what}: {(err / step).max().item():.3f} steps apart"


def check_write_kv(num_tokens, num_kv_heads, head_dim, dtype=torch.float16, device="cpu", seed=0):
    from rooflm.kernels.kv_cache import write_kv_cache, write_kv_cache_ref

    g = torch.Generator().manual_seed(seed)
    block_size, num_blocks = 8, math.ceil(num_tokens / 8) + 2
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[::3] = -1
    kv = torch.randn(num_tokens, 2, num_kv_heads, head_dim, generator=g).to(dtype).to(device)
    ref = cache.clone()
    write_kv_cache(kv[:, 0], kv[:, 1], cache, slots.to(device))
    write_kv_cache_ref(kv[:, 0], kv[:, 1], ref, slots.to(device))
    assert torch.equal(cache, ref)


def check_rotary(num_tokens, num_heads, num_kv_heads, head_dim, rot_dim, is_neox, write, dtype=torch.float16,
                 device="cpu", seed=0, per_token=False):
    from rooflm.kernels.kv_cache import rotary_write_kv_cache, rotary_write_kv_cache_ref

    g = torch.Generator().manual_seed(seed)
    max_pos = 4096
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos().float().to(device), ang.sin().float().to(device)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=g).to(dtype).to(device)
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    pos = torch.randint(0, max_pos, (num_tokens,), generator=g).to(device)
    block_size, num_blocks = 16, math.ceil(num_tokens / 16) + 1
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[1::4] = -1
    slots = slots.to(device)
    ref_cache = cache.clone()
    if per_token:  # the model's form: cos/sin gathered per token, in the model's dtype
        cos, sin, pos = cos[pos].to(dtype), sin[pos].to(dtype), None
    q_ref, k_ref = rotary_write_kv_cache_ref(q, k, v, pos, cos, sin, ref_cache if write else None, slots, is_neox)
    rotary_write_kv_cache(q, k, v, pos, cos, sin, cache if write else None, slots, is_neox)  # q, k in place
    assert_close(q, q_ref, dtype, "rotary q")
    assert_close(k, k_ref, dtype, "rotary k")
    if write:
        assert_close(cache, ref_cache, dtype, "rotary cache")


def check_rmsnorm(num_tokens, hidden, with_residual, dtype=torch.float16, device="cpu", seed=0):
    from rooflm.kernels.rmsnorm import rms_norm, rms_norm_ref

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(device)
    r = torch.randn(num_tokens, hidden, generator=g).to(dtype).to(device) if with_residual else None
    out = rms_norm(x, w, 1e-5, r)
    ref = rms_norm_ref(x, w, 1e-5, r)
    if with_residual:
        if dtype == torch.bfloat16 and device == "cpu":
            # Triton 3.9's interpreter truncates float32 -> bfloat16 (the GPU rounds to nearest): one ulp apart
            assert_close(out[1], ref[1], dtype, "residual")
        else:
            assert torch.equal(out[1], ref[1]), "the new residual must be exactly x + residual rounded to the dtype"
        out, ref = out[0], ref[0]
    assert_close(out, ref, dtype, "rmsnorm")


def check_silu_and_mul(num_tokens, d, dtype=torch.float16, device="cpu", seed=0):
    from rooflm.kernels.activation import silu_and_mul, silu_and_mul_ref

    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(num_tokens, 2 * d, generator=g)).to(dtype).to(device)
    assert_close(silu_and_mul(x), silu_and_mul_ref(x), dtype, "silu_and_mul")


def check_gemv(cfg, m, n, k, bias, dtype=torch.float16, device="cpu", seed=0):
    from rooflm.kernels.gemv import gemv

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device) if bias else None
    out = gemv(x, w, b, cfg)
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    limit = {torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert rel < limit, f"gemv {cfg} M={m} N={n} K={k}: relative error {rel:.2e} >= {limit}"


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in output"
    return ((out.double() - ref).norm() / ref.norm()).item()


def check_rmsnorm_gemv(cfg, m, n, k, with_residual, bias=False, dtype=torch.float16, device="cpu", seed=0,
                       one_pass=False):
    """The fused add + RMSNorm + GEMV against the unfused reference norm followed by a float64 product; the new
    residual stream must be exactly x + residual rounded to the dtype."""
    from rooflm.kernels.fused_gemv import rmsnorm_gemv
    from rooflm.kernels.rmsnorm import rms_norm_ref

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    r = torch.randn(m, k, generator=g).to(dtype).to(device) if with_residual else None
    nw = (1 + 0.2 * torch.randn(k, generator=g)).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device) if bias else None
    out, res = rmsnorm_gemv(x, nw, 1e-5, w, b, cfg, r, one_pass=one_pass)
    h = rms_norm_ref(x, nw, 1e-5, r)
    h, res_ref = (h, x) if r is None else h
    ref = torch.nn.functional.linear(h.double(), w.double(), None if b is None else b.double())
    rel = _rel_err(out, ref)
    limit = {torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert out.shape == (m, n) and rel < limit, (f"rmsnorm_gemv {cfg} one_pass={one_pass} M={m} N={n} K={k}: "
                                                 f"relative error {rel:.2e}")
    if dtype == torch.bfloat16 and device == "cpu":
        # Triton 3.9's interpreter truncates float32 -> bfloat16 (the GPU rounds to nearest): one ulp apart
        assert_close(res, res_ref, dtype, "residual")
    else:
        assert torch.equal(res, res_ref), "the new residual must be exactly x + residual rounded to the dtype"


def check_silu_mul_gemv(cfg, m, n, d, bias=False, dtype=torch.float16, device="cpu", seed=0):
    """The fused SiLU-and-mul + GEMV against the unfused reference activation followed by a float64 product."""
    from rooflm.kernels.activation import silu_and_mul_ref
    from rooflm.kernels.fused_gemv import silu_mul_gemv

    g = torch.Generator().manual_seed(seed)
    gu = (3 * torch.randn(m, 2 * d, generator=g)).to(dtype).to(device)
    w = (torch.randn(n, d, generator=g) / math.sqrt(d)).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device) if bias else None
    out = silu_mul_gemv(gu, w, b, cfg)
    ref = torch.nn.functional.linear(silu_and_mul_ref(gu).double(), w.double(), None if b is None else b.double())
    rel = _rel_err(out, ref)
    limit = {torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert out.shape == (m, n) and rel < limit, f"silu_mul_gemv {cfg} M={m} N={n} d={d}: relative error {rel:.2e}"


def gemv_test_configs():
    """GEMV tile configurations the kernel tests sweep: reduction by sums and by tl.dot, with and without split-K."""
    from rooflm.kernels.gemv import GemvConfig

    return [GemvConfig(False, 16, 64, 1), GemvConfig(False, 16, 64, 3), GemvConfig(True, 16, 64, 1),
            GemvConfig(True, 32, 32, 2)]


def new_token_step(num_heads, num_kv_heads, head_dim, block_size, lens, dtype, device, seed, rot_dim=None):
    """A decode step's unrotated q, k, v (views of one projection output), its angles, and a paged cache whose slots
    for the new tokens hold NaN (they are written by the step)."""
    g = torch.Generator().manual_seed(seed)
    cache, tables = make_paged(lens, num_kv_heads, head_dim, block_size, dtype, device, gen=g)
    n = len(lens)
    # q, k, v as views of one projection output, the way the model hands them over
    qkv = torch.randn(n, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype).to(device)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.view(n, num_heads, head_dim)
    k = k.view(n, num_kv_heads, head_dim)
    v = v.view(n, num_kv_heads, head_dim)
    half = (rot_dim or head_dim) // 2
    angles = torch.rand(n, half, generator=g) * 6.0
    cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
    slots = [-1 if L == 0 else int(tables[i, (L - 1) // block_size]) * block_size + (L - 1) % block_size
             for i, L in enumerate(lens)]
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    flat = cache.view(2, -1, num_kv_heads, head_dim)
    for s in slots:  # the new token's slot holds garbage until it is written: reading it must not matter
        if s >= 0:
            flat[:, s] = float("nan")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return q, k, v, cos, sin, cache, tables, seq_lens, slot_mapping


def check_decode_new_token(num_heads, num_kv_heads, head_dim, block_size, lens, seed, dtype=torch.float16,
                          device="cpu", window=None, rot_dim=None, **kw):
    """Decode attention given the step's token (``NewTokenKV``) against the rotary kernel then decode attention: the
    same output and cache bit for bit; and against the torch twins within the dtype's tolerance."""
    from rooflm.kernels.decode_attention import NewTokenKV, paged_decode_attention, paged_decode_attention_ref
    from rooflm.kernels.kv_cache import rotary_write_kv_cache

    q, k, v, cos, sin, cache, tables, seq_lens, slots = new_token_step(
        num_heads, num_kv_heads, head_dim, block_size, lens, dtype, device, seed, rot_dim)
    scale = head_dim ** -0.5
    q0, k0 = q.clone(), k.clone()
    fused_cache, plain_cache, ref_cache = cache.clone(), cache.clone(), cache.clone()
    fused = torch.full_like(q, float("nan"))
    paged_decode_attention(q, fused_cache, tables, seq_lens, scale, window, out=fused,
                           new_kv=NewTokenKV(k, v, cos, sin, slots), **kw)
    assert torch.equal(q, q0) and torch.equal(k, k0), "the fused call must not rotate its inputs in place"

    rq, rk = rotary_write_kv_cache(q.clone(), k.clone(), v, None, cos, sin, plain_cache, slots)
    plain = torch.full_like(q, float("nan"))
    paged_decode_attention(rq, plain_cache, tables, seq_lens, scale, window, out=plain, **kw)
    what = f"H={num_heads}/{num_kv_heads} D={head_dim} lens={lens} w={window} {kw}"
    assert not torch.isnan(fused).any(), f"{what}: NaN (a stale cache row was read)"
    assert torch.equal(fused, plain), f"{what}: output differs from rotary kernel + decode attention"
    assert torch.equal(fused_cache.nan_to_num(7.0), plain_cache.nan_to_num(7.0)), f"{what}: cache differs"

    ref = paged_decode_attention_ref(q, ref_cache, tables, seq_lens, scale, window,
                                     new_kv=NewTokenKV(k, v, cos, sin, slots))
    assert_close(fused, ref, dtype, what)
    assert_close(fused_cache.nan_to_num(7.0), ref_cache.nan_to_num(7.0), dtype, what + " (cache)")


def tiny_llama(device: str, layers: int = 2, seed: int = 4, hidden: int = 64, inter: int = 48, heads: int = 4,
               kv_heads: int = 2, vocab: int = 96, std: float = 0.1):
    """A float16 Llama with dummy weights whose ops chose the Triton path (the interpreter on the CPU)."""
    from rooflm.config import ModelConfig
    from rooflm.layers.custom_op import op_selection
    from rooflm.loader.dummy import init_dummy_weights
    from rooflm.models import get_model_class

    cfg = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
                                    "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
                                    "num_attention_heads": heads, "num_key_value_heads": kv_heads})
    with torch.device(device), op_selection(device, ops="triton"):
        model = get_model_class(cfg)(cfg).half()
    init_dummy_weights(model, seed=seed, std=std)
    return model
