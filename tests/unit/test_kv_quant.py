"""The quantized KV cache in plain torch: quantization bounds, the reference backend over an int8 / fp8 cache,
block copies, sizing and the kv_cache_dtype option (config, LLM, CLI)."""
from __future__ import annotations

import argparse

import pytest
import torch

from rooflm.attention.kv_quant import (QuantizedKVCache, allocate_kv_cache, copy_blocks, dequantize_rows,
                                       kv_bytes_per_token_head, kv_cache_nbytes, qmax, quantize_rows)
from rooflm.attention.metadata_utils import build_attention_metadata
from rooflm.attention.torch_ref import TorchRefAttention

KV = ["int8", "fp8"]
QDTYPE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def _rows(g: torch.Generator, *shape: int) -> torch.Tensor:
    x = torch.randn(*shape, generator=g) * 10 ** (4 * torch.rand(*shape[:-1], 1, generator=g) - 3)
    x[0] = 0  # all-zero rows: scale 0, values 0, no NaN
    return x


@pytest.mark.parametrize("kv", KV)
def test_round_trip_bound(kv):
    x = _rows(torch.Generator().manual_seed(0), 64, 4, 96)
    q, s = quantize_rows(x, QDTYPE[kv])
    assert q.dtype == QDTYPE[kv] and s.shape == (64, 4) and s.dtype == torch.float32
    err = (dequantize_rows(q, s) - x).abs()
    bound = s[..., None] / 2 if kv == "int8" else x.abs() / 16 + s[..., None] / 1024
    assert (err <= bound * (1 + 1e-6) + 1e-12).all()
    torch.testing.assert_close(s, x.abs().amax(-1) / qmax(QDTYPE[kv]), rtol=0, atol=0)
    assert not torch.isnan(dequantize_rows(q, s)).any() and bool((s[0] == 0).all())


def test_int8_rounds_to_nearest():
    """Scale 1 (a row whose absmax is 127): values round to the nearest integer, halves up."""
    x = torch.tensor([[127.0, 2.5, -2.5, 0.49, -0.51, -126.6]])
    q, s = quantize_rows(x, torch.int8)
    assert s.item() == 1.0
    assert q.tolist() == [[127, 3, -2, 0, -1, -127]]


def _prefill(backend, cache, q, k, v, chunks, bs):
    table = [list(range(cache.shape[1]))]
    cos = torch.ones(q.shape[0], q.shape[-1] // 2)
    sin = torch.zeros_like(cos)
    outs = []
    for start, end in chunks:
        meta, _ = build_attention_metadata(table, [start], [end - start], bs)
        rq, _ = backend.rotary_and_write(q[start:end], k[start:end], v[start:end], cos[start:end], sin[start:end],
                                         cache, meta)
        outs.append(backend.attend(rq, cache, meta, q.shape[-1] ** -0.5))
    return torch.cat(outs)


@pytest.mark.parametrize("kv,limit", [("int8", 0.02), ("fp8", 0.08)])
def test_reference_backend_over_a_quantized_cache(kv, limit):
    """Close to attention over the unquantized cache, and a prefill split into chunks gives exactly what the
    one-shot prefill gives (every token's K/V is read back from the cache, the step's own included)."""
    g = torch.Generator().manual_seed(1)
    n, bs, d = 37, 8, 64
    q, k, v = torch.randn(n, 4, d, generator=g), torch.randn(n, 2, d, generator=g), torch.randn(n, 2, d, generator=g)
    backend = TorchRefAttention()
    full = _prefill(backend, allocate_kv_cache(5, bs, 2, d, torch.float32), q, k, v, [(0, n)], bs)
    one = _prefill(backend, allocate_kv_cache(5, bs, 2, d, torch.float32, kv), q, k, v, [(0, n)], bs)
    chunked = _prefill(backend, allocate_kv_cache(5, bs, 2, d, torch.float32, kv), q, k, v, [(0, 13), (13, 30),
                                                                                             (30, n)], bs)
    rel = ((one - full).norm() / full.norm()).item()
    assert 0 < rel < limit, f"{kv}: relative error {rel:.4f}"
    torch.testing.assert_close(chunked, one, rtol=1e-6, atol=1e-6)
    # decode steps (the batched path) read the same dequantized cache
    cache = allocate_kv_cache(5, bs, 2, d, torch.float32, kv)
    _prefill(backend, cache, q, k, v, [(0, n - 1)], bs)
    last = _prefill(backend, cache, q, k, v, [(n - 1, n)], bs)
    torch.testing.assert_close(last, one[-1:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv", KV)
def test_copy_blocks_moves_scales(kv):
    cache = allocate_kv_cache(4, 2, 1, 8, torch.float16, kv)
    x = _rows(torch.Generator().manual_seed(2), 2, 4, 2, 1, 8)
    q, s = quantize_rows(x, cache.dtype)
    cache.data.copy_(q)
    cache.scales.copy_(s)
    before = cache.dequantize()
    copy_blocks(cache, torch.tensor([1, 3]), torch.tensor([0, 2]))
    after = cache.dequantize()
    assert torch.equal(after[:, 0], before[:, 1]) and torch.equal(after[:, 2], before[:, 3])
    assert torch.equal(after[:, 1], before[:, 1]) and torch.equal(cache.scales[:, 0], s[:, 1])


def test_allocation_and_bytes():
    plain = allocate_kv_cache(3, 16, 2, 128, torch.float16)
    assert isinstance(plain, torch.Tensor) and plain.dtype == torch.float16
    for kv in KV:
        c = allocate_kv_cache(3, 16, 2, 128, torch.float16, kv)
        assert isinstance(c, QuantizedKVCache) and c.dtype == QDTYPE[kv] and c.scales.shape == (2, 3, 16, 2)
        per_token_head = kv_cache_nbytes(c) / (3 * 16 * 2)
        assert per_token_head == kv_bytes_per_token_head(128, torch.float16, kv) == 2 * (128 + 4)
    assert kv_cache_nbytes(plain) / (3 * 16 * 2) == kv_bytes_per_token_head(128, torch.float16) == 2 * 2 * 128
    with pytest.raises(ValueError, match="QuantizedKVCache.data"):
        QuantizedKVCache(torch.zeros(2, 1, 1, 1, 4), torch.zeros(2, 1, 1, 1))
    with pytest.raises(ValueError, match="QuantizedKVCache.scales"):
        QuantizedKVCache(torch.zeros(2, 1, 1, 1, 4, dtype=torch.int8), torch.zeros(2, 1, 1))


@pytest.mark.parametrize("kv", KV)
def test_a_16_bit_model_pool_holds_about_twice_the_tokens(kv):
    from rooflm.config import load_model_config
    from rooflm.worker.model_runner import kv_bytes_per_block

    cfg = load_model_config("llama-2-7b")
    auto = kv_bytes_per_block(cfg, 16, torch.float16)
    quant = kv_bytes_per_block(cfg, 16, torch.float16, kv)
    budget = 4 * 2**30
    ratio = (budget // quant) / (budget // auto)
    assert 1.9 < ratio < 2.0, ratio  # 1 byte a value against 2, plus 4 bytes of scale per 128 values


def test_bad_kv_cache_dtype_names_the_field():
    from rooflm.config import CacheConfig, EngineConfig
    from rooflm.llm import LLM

    with pytest.raises(ValueError, match=r"EngineConfig\.kv_cache_dtype='int4'"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match=r"CacheConfig\.kv_cache_dtype='fp16'"):
        CacheConfig(kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='float8'"):
        LLM(kv_cache_dtype="float8")
    assert EngineConfig(kv_cache_dtype="fp8").cache_config().kv_cache_dtype == "fp8"


def test_cli_flag():
    from rooflm.entrypoints.args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--kv-cache-dtype", "int8"])).kv_cache_dtype == "int8"
    assert engine_config_from_args(parser.parse_args([])).kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        engine_config_from_args(parser.parse_args(["--kv-cache-dtype", "int3"]))
