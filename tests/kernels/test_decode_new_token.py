"""Decode attention that rotates the step's token and writes it into the cache itself (``NewTokenKV``) against the
two kernels it replaces (the rotary + cache-write kernel, then decode attention): the same output and the same cache,
bit for bit, for every inner loop; and against the torch twins within the dtype's tolerance."""
import pytest
import torch

from kernel_checks import check_decode_new_token, new_token_step


# Every inner loop: MHA's dot-free loop with one softmax state and with a state per tile row, tl.dot for MHA and
# for GQA; one split (no combine), several (the new token in a middle split's tile), more splits than tiles; a
# padded row (seq_len 0, slot -1); a sequence whose only token is the new one.
@pytest.mark.parametrize("num_heads,num_kv_heads,use_dot,lanes", [
    (4, 4, None, False), (4, 4, None, True), (4, 4, True, False), (8, 2, None, False)])
@pytest.mark.parametrize("num_splits,block_n", [(1, 16), (3, 16), (8, 32)])
def test_fused_new_token_equals_two_kernels(device, num_heads, num_kv_heads, use_dot, lanes, num_splits, block_n):
    check_decode_new_token(num_heads, num_kv_heads, 32, 8, [1, 17, 70, 0, 33], seed=num_splits + block_n,
                          device=device, use_dot=use_dot, lanes=lanes, num_splits=num_splits, block_n=block_n)


@pytest.mark.parametrize("window", [1, 7])
def test_fused_new_token_sliding_window(device, window):
    check_decode_new_token(4, 4, 32, 8, [5, 40, 57], seed=window, device=device, window=window, num_splits=3,
                          block_n=16, lanes=True)


def test_fused_new_token_partial_rotary_bfloat16_and_fused_reduce(device):
    # head_dim 80 (not a power of two) with RoPE on its first 48 dimensions; the last split program combines
    check_decode_new_token(4, 2, 80, 16, [19, 50, 1], seed=4, dtype=torch.bfloat16, device=device, rot_dim=48,
                          num_splits=4, fused_reduce=True)


def test_fused_new_token_default_plan(device):
    check_decode_new_token(8, 8, 64, 16, [100, 3], seed=9, device=device)


def test_fused_new_token_rejects_bad_inputs(device):
    from rooflm.attention.kv_quant import QuantizedKVCache
    from rooflm.kernels.decode_attention import NewTokenKV, paged_decode_attention

    q, k, v, cos, sin, cache, tables, seq_lens, slots = new_token_step(4, 2, 32, 8, [5, 9], torch.float16, device,
                                                                       0)
    call = lambda c=cache, **f: paged_decode_attention(  # noqa: E731
        q, c, tables, seq_lens, 1.0, new_kv=NewTokenKV(**{**dict(k=k, v=v, cos=cos, sin=sin, slot_mapping=slots), **f}))
    with pytest.raises(ValueError, match=r"new_kv\.k \(2, 4, 32\)"):
        call(k=torch.zeros(2, 4, 32, dtype=q.dtype, device=device))
    with pytest.raises(ValueError, match=r"new_kv\.cos/sin"):
        call(cos=torch.zeros(2, 20, dtype=q.dtype, device=device), sin=torch.zeros(2, 20, dtype=q.dtype, device=device))
    with pytest.raises(ValueError, match=r"new_kv\.slot_mapping \(3,\)"):
        call(slot_mapping=torch.zeros(3, dtype=torch.int64, device=device))
    quantized = QuantizedKVCache(cache.to(torch.int8), torch.ones(cache.shape[:-1], device=device))
    with pytest.raises(ValueError, match="quantized cache"):
        call(c=quantized)


@pytest.mark.parametrize("q_lens,heads,kv_cache_dtype,fused", [
    ([1, 1, 1], 1, "auto", True),  # a decode step of MHA at a small batch (the dot-free plan): one kernel
    ([1, 1, 1], 4, "auto", False),  # GQA (the tl.dot plan): two kernels, as measured faster there
    ([1, 1, 1], 1, "int8", False),  # a quantized cache is written by the rotary kernel, which quantizes
    ([1, 4, 1], 1, "auto", False),  # a step with several tokens of one sequence: the prefill kernel
])
def test_triton_backend_fuses_decode_steps_only(device, monkeypatch, q_lens, heads, kv_cache_dtype, fused):
    # one KV head for 3 sequences: few enough programs for the split plans on the interpreter's 8 "SMs" and on a GPU
    from kernel_checks import make_step

    from rooflm.attention.backend import rotary_write_then_attend
    from rooflm.attention.triton_backend import TritonAttention

    def run(backend):
        g = torch.Generator().manual_seed(11)
        q, k, v, cache, meta = make_step([5, 16, 40], q_lens, heads, 1, 32, 16, torch.float16, device, g,
                                         kv_cache_dtype)
        q0 = q.clone()
        if backend is None:
            out = rotary_write_then_attend(TritonAttention(), q, k, v, *rope(q.shape[0]), cache, meta, 0.25, None)
        else:
            out = backend.rotary_write_attend(q, k, v, *rope(q.shape[0]), cache, meta, 0.25, None)
        data = cache.data if kv_cache_dtype != "auto" else cache
        return out, data, torch.equal(q, q0)

    def rope(n):
        angles = torch.linspace(0.0, 5.0, n * 16).view(n, 16)
        return angles.cos().half().to(device), angles.sin().half().to(device)

    out, cache, q_untouched = run(TritonAttention())
    plain, plain_cache, _ = run(None)
    assert q_untouched == fused  # the two-call path rotates q in place; the fused kernel does not
    assert torch.equal(out, plain) and torch.equal(cache, plain_cache)
    monkeypatch.setenv("ROOFLM_DECODE_FUSED_ROPE", "0")
    assert not run(TritonAttention())[2], "ROOFLM_DECODE_FUSED_ROPE=0 must keep the two kernels"
