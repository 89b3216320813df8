"""Quantized KV cache (kv_cache_dtype "int8" / "fp8"): the Triton write and attention kernels against their torch
twins, and the error bound of a write + read round trip. Small shapes (CPU: Triton's interpreter)."""
import math

import pytest
import torch

from kernel_checks import assert_close, check_backend, check_decode, check_prefill, check_quantized_close

KV = ["int8", "fp8"]


def _rows(num_tokens, num_kv_heads, head_dim, dtype, device, g):
    """k, v rows with magnitudes spread over four decades, one all-zero row (its scale must be 0, not NaN)."""
    kv = torch.randn(num_tokens, 2, num_kv_heads, head_dim, generator=g)
    kv = kv * 10 ** (4 * torch.rand(num_tokens, 2, num_kv_heads, 1, generator=g) - 3)
    kv[1, :, 0] = 0
    kv = kv.to(dtype).to(device)
    return kv[:, 0], kv[:, 1]


def _empty_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, kv, device):
    from rooflm.attention.kv_quant import allocate_kv_cache

    return allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, kv, device)


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_write_kv_cache_quantized_matches_twin(device, kv, dtype):
    from rooflm.kernels.kv_cache import write_kv_cache, write_kv_cache_ref

    g = torch.Generator().manual_seed(3)
    k, v = _rows(11, 3, 40, dtype, device, g)
    cache = _empty_cache(4, 8, 3, 40, dtype, kv, device)
    ref = cache.clone()
    slots = torch.randperm(32, generator=g)[:11]
    slots[::4] = -1
    write_kv_cache(k, v, cache, slots.to(device))
    write_kv_cache_ref(k, v, ref, slots.to(device))
    written = torch.zeros(32, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    written = written.view(4, 8).to(device)
    assert bool((ref.scales[:, ~written] == 0).all()) and bool((ref.scales[:, written] > 0).any())
    if device == "cpu":  # the interpreter computes in numpy float32 as torch does: the same bytes
        assert torch.equal(cache.data.view(torch.uint8), ref.data.view(torch.uint8))
        assert torch.equal(cache.scales, ref.scales)
    else:
        check_quantized_close(cache, ref, what=f"write {kv}")
        assert torch.equal(cache.scales[:, ~written], ref.scales[:, ~written])


@pytest.mark.parametrize("kv", KV)
def test_write_read_round_trip_error_bound(device, kv):
    """int8: |x - q * s| <= s / 2 per element; fp8: half an e4m3 step, 2^-4 of |x| (2^-10 of s among subnormals).
    The largest element of each row is stored at the format's limit (127 or 448 times the scale)."""
    from rooflm.attention.kv_quant import qmax
    from rooflm.kernels.kv_cache import write_kv_cache

    g = torch.Generator().manual_seed(7)
    k, v = _rows(16, 2, 64, torch.float16, device, g)
    cache = _empty_cache(2, 8, 2, 64, torch.float16, kv, device)
    write_kv_cache(k, v, cache, torch.arange(16, device=device))
    x = torch.stack([k, v]).float().view(2, 2, 8, 2, 64)
    s = cache.scales[..., None]
    err = (cache.dequantize() - x).abs()
    bound = s / 2 if kv == "int8" else x.abs() / 16 + s / 1024
    assert (err <= bound * (1 + 1e-5) + 1e-9).all(), f"{kv}: {(err / bound.clamp_min(1e-30)).max().item():.3f}"
    amax = x.abs().amax(-1)
    torch.testing.assert_close(cache.scales, amax / qmax(cache.dtype), rtol=1e-6, atol=0)
    top = cache.data.float().abs().amax(-1)
    assert torch.equal(top[amax > 0], torch.full_like(top[amax > 0], qmax(cache.dtype)))
    assert bool((cache.scales[amax == 0] == 0).all()) and bool((cache.data.float()[amax == 0] == 0).all())


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("head_dim,rot_dim", [(64, 64), (64, 32)])
def test_rotary_write_quantized(device, kv, head_dim, rot_dim):
    """The fused rotary + quantizing write: rotated q and k as without quantization, the cache as the reference
    quantizes the rotated k (partial rotary: the pass-through tail shares the row's scale)."""
    from kernel_checks import quantize_cache

    from rooflm.kernels.kv_cache import rotary_write_kv_cache, rotary_write_kv_cache_ref

    g = torch.Generator().manual_seed(rot_dim)
    dtype = torch.float16
    ang = 100 * torch.rand(9, rot_dim // 2, generator=g)
    cos, sin = ang.cos().to(dtype).to(device), ang.sin().to(dtype).to(device)
    qkv = torch.randn(9, 4 + 2 * 2, head_dim, generator=g).to(dtype).to(device)
    q, k, v = qkv.split([4, 2, 2], dim=1)
    cache = quantize_cache(torch.randn(2, 2, 8, 2, head_dim, generator=g).to(dtype).to(device), kv)
    ref = cache.clone()
    slots = torch.randperm(16, generator=g)[:9]
    slots[1::4] = -1
    slots = slots.to(device)
    q_ref, k_ref = rotary_write_kv_cache_ref(q, k, v, None, cos, sin, ref, slots)
    rotary_write_kv_cache(q, k, v, None, cos, sin, cache, slots)
    assert_close(q, q_ref, dtype, "rotary q")
    assert_close(k, k_ref, dtype, "rotary k")
    # the twin rotates in float32 too, but a GPU may contract products into FMAs: k may be one ulp apart
    check_quantized_close(cache, ref, what=f"rotary write {kv}", input_rel=torch.finfo(dtype).eps)
    written = torch.zeros(16, dtype=torch.bool)
    written[slots.cpu()[slots.cpu() >= 0]] = True
    written = written.view(2, 8).to(device)
    assert torch.equal(cache.scales[:, ~written], ref.scales[:, ~written])


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("num_heads,num_kv_heads,use_dot,dtype", [
    (8, 2, None, torch.float16),  # GQA: tl.dot over the group
    (4, 4, False, torch.float16),  # MHA: the dot-free loop
    (4, 1, None, torch.bfloat16),
])
def test_decode_quantized(device, kv, num_heads, num_kv_heads, use_dot, dtype):
    check_decode(num_heads, num_kv_heads, 32, 8, [1, 17, 40, 0], num_splits=2, dtype=dtype, device=device,
                 seed=num_heads, kv_cache_dtype=kv, use_dot=use_dot)


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("window", [None, 6])
def test_prefill_quantized(device, kv, window):
    check_prefill(4, 2, 32, 8, [16, 0, 5], [9, 20, 1], window=window, device=device, seed=11, kv_cache_dtype=kv)


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("ctx_lens,q_lens", [([5, 16, 31], [1, 1, 1]), ([0, 12], [19, 4])])
def test_backend_quantized_matches_reference(device, kv, ctx_lens, q_lens):
    check_backend(8, 2, 32, 16, ctx_lens, q_lens, device=device, seed=sum(ctx_lens), kv_cache_dtype=kv)


def test_chunked_prefill_reads_what_one_shot_reads(device):
    """Attention reads the step's own tokens back from the quantized cache, so the last chunk of a prefill split in
    two attends to the same keys and values as the one-shot prefill of the whole prompt: the same outputs."""
    from kernel_checks import make_paged

    from rooflm.attention.metadata_utils import build_attention_metadata
    from rooflm.attention.triton_backend import TritonAttention

    g = torch.Generator().manual_seed(1)
    n, split, bs, dtype = 23, 14, 8, torch.float16
    q = torch.randn(n, 4, 32, generator=g).to(dtype).to(device)
    k = torch.randn(n, 2, 32, generator=g).to(dtype).to(device)
    v = torch.randn(n, 2, 32, generator=g).to(dtype).to(device)
    cos = torch.ones(n, 16, dtype=dtype, device=device)  # no rotation: the queries stay comparable
    sin = torch.zeros(n, 16, dtype=dtype, device=device)
    backend, table = TritonAttention(), [list(range(math.ceil(n / bs)))]
    outs = []
    for chunks in ([(0, n)], [(0, split), (split, n)]):
        cache, _ = make_paged([n], 2, 32, bs, dtype, device, gen=torch.Generator().manual_seed(0),
                              kv_cache_dtype="int8")
        for start, end in chunks:
            meta, _ = build_attention_metadata(table, [start], [end - start], bs, device)
            rq, _ = backend.rotary_and_write(q[start:end].clone(), k[start:end].clone(), v[start:end].clone(),
                                             cos[start:end], sin[start:end], cache, meta)
            out = backend.attend(rq, cache, meta, 32 ** -0.5)
        outs.append(out[-(n - split):] if chunks[0][1] == n else out)
    assert_close(outs[1], outs[0], dtype, "chunked vs one-shot prefill over an int8 cache")


@pytest.mark.parametrize("kv", KV)
def test_decode_quantized_per_lane_softmax(device, kv):
    """The dot-free loop with its softmax state kept per tile row (lanes=True) reads the scales too."""
    from kernel_checks import make_paged

    from rooflm.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref

    g = torch.Generator().manual_seed(4)
    lens = [3, 29, 50]
    cache, tables = make_paged(lens, 2, 32, 8, torch.float16, device, gen=g, kv_cache_dtype=kv)
    q = torch.randn(len(lens), 2, 32, generator=g).to(torch.float16).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    out = paged_decode_attention(q, cache, tables, seq_lens, 32 ** -0.5, num_splits=2, use_dot=False, lanes=True,
                                 block_n=16)
    ref = paged_decode_attention_ref(q, cache, tables, seq_lens, 32 ** -0.5)
    assert_close(out, ref, torch.float16, f"decode lanes kv={kv}")
