"""Quantized paged KV cache: int8 or fp8 (e4m3) values with one float32 scale per token and KV head.

``kv_cache_dtype`` (vLLM's name): "auto" keeps K/V in the model's dtype; "int8" and "fp8" store each (token, KV head)
row of ``head_dim`` values as ``round(x / s)`` with ``s = absmax(row) / QMAX`` (QMAX = 127 for int8, 448 for
float8_e4m3fn), computed when the row is written. A cache of one layer is then a ``QuantizedKVCache``: the values
``data`` [2, num_blocks, block_size, num_kv_heads, head_dim] and the scales ``scales`` [2, num_blocks, block_size,
num_kv_heads] float32, both addressed by the same block ids and slots, so prefix-cache sharing and block copies move
a block's scales with its values. With head_dim 128 a token of one layer takes 2 * (128 + 4) bytes per KV head
instead of 2 * 256 in 16-bit: the same memory holds about 1.94x the tokens.

fp8 also takes a per-token-per-head scale rather than one static scale per tensor: it needs no calibration pass, it
cannot overflow e4m3's +-448 range on an outlier token, and each row uses the format's full precision, at 4 bytes per
row of scale. Symmetric absmax scaling per token follows KIVI (Liu et al. 2024) for values and, per head, the int8 KV
caches of vLLM and TensorRT-LLM.

The write path quantizes the *rotated* key as rounded to the model's dtype (the value the unquantized cache would
hold), so the torch reference and the Triton kernels quantize the same numbers. int8 rounds to nearest, halves up
(``floor(y + 0.5)``), in both, so |x - q * s| <= s / 2 per element; fp8 rounds to nearest even.

Attention reads every context token from the cache, the step's own new tokens included (they are written first): a
chunked or prefix-cached prefill then sees exactly the keys and values a one-shot prefill of the same tokens sees.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rooflm.config import KV_CACHE_DTYPES
_QDTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_DTYPE = torch.float32


def check_kv_cache_dtype(value: object, owner: str = "EngineConfig") -> str:
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"{owner}.kv_cache_dtype={value!r} is invalid: expected one of {KV_CACHE_DTYPES}")
    return value  # type: ignore[return-value]


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of the cache's values: the model's dtype for "auto", int8 or float8_e4m3fn otherwise."""
    check_kv_cache_dtype(kv_cache_dtype)
    return model_dtype if kv_cache_dtype == "auto" else _QDTYPES[kv_cache_dtype]


def is_quantized_dtype(dtype: torch.dtype) -> bool:
    return dtype in _QMAX


def qmax(dtype: torch.dtype) -> float:
    return _QMAX[dtype]


@dataclass
class QuantizedKVCache:
    """One layer's quantized paged cache: the values and, beside them, one scale per (K or V, slot, KV head)."""

    data: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim] int8 or float8_e4m3fn
    scales: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads] float32

    def __post_init__(self) -> None:
        if not is_quantized_dtype(self.data.dtype):
            raise ValueError(f"QuantizedKVCache.data has dtype {self.data.dtype}: expected int8 or float8_e4m3fn")
        if tuple(self.scales.shape) != tuple(self.data.shape[:-1]) or self.scales.dtype != SCALE_DTYPE:
            raise ValueError(f"QuantizedKVCache.scales {tuple(self.scales.shape)} {self.scales.dtype} does not fit "
                             f"data {tuple(self.data.shape)}: expected {tuple(self.data.shape[:-1])} float32")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole cache in ``dtype`` (tests and debugging)."""
        return (self.data.float() * self.scales[..., None]).to(dtype)

    def clone(self) -> "QuantizedKVCache":
        return QuantizedKVCache(self.data.clone(), self.scales.clone())


KVCache = torch.Tensor | QuantizedKVCache


def allocate_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, model_dtype: torch.dtype,
                      kv_cache_dtype: str = "auto", device: torch.device | str = "cpu") -> KVCache:
    """A zeroed cache of one layer (zero scales dequantize to zeros, so never-written slots read as 0, not NaN)."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    dtype = kv_storage_dtype(kv_cache_dtype, model_dtype)
    data = torch.zeros(shape, dtype=dtype, device=device)
    if kv_cache_dtype == "auto":
        return data
    return QuantizedKVCache(data, torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device))


def kv_cache_nbytes(cache: KVCache) -> int:
    if isinstance(cache, QuantizedKVCache):
        return cache.nbytes
    return cache.numel() * cache.element_size()


def kv_bytes_per_token_head(head_dim: int, model_dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """K and V of one token and KV head in one layer, scales included."""
    dtype = kv_storage_dtype(kv_cache_dtype, model_dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    scale = 0 if kv_cache_dtype == "auto" else torch.empty((), dtype=SCALE_DTYPE).element_size()
    return 2 * (head_dim * elem + scale)


def copy_blocks(cache: KVCache, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks ``src`` -> ``dst`` (copy-on-write), scales with their values."""
    if isinstance(cache, QuantizedKVCache):
        cache.data[:, dst] = cache.data[:, src]
        cache.scales[:, dst] = cache.scales[:, src]
    else:
        cache[:, dst] = cache[:, src]


# ---------------------------------------------------------------------------------------------------------------------
# The torch reference of quantization (the Triton write kernels' twin)
# ---------------------------------------------------------------------------------------------------------------------
def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (values [..., head_dim] in ``dtype``, scales [...] float32), one scale per row."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / _QMAX[dtype]
    y = xf / torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]
    m = _QMAX[dtype]
    if dtype == torch.int8:
        q = torch.floor(y + 0.5).clamp(-m, m).to(torch.int8)
    else:
        q = y.clamp(-m, m).to(dtype)
    return q, scale


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """values [..., head_dim], scales [...] -> float32 [..., head_dim]."""
    return q.float() * scales[..., None]


def write_quantized(k: torch.Tensor, v: torch.Tensor, cache: QuantizedKVCache, slot_mapping: torch.Tensor) -> None:
    """Quantize k, v [num_tokens, num_kv_heads, head_dim] and scatter them and their scales at ``slot_mapping``
    (-1 skipped)."""
    _, nb, bs, hkv, d = cache.data.shape
    # index_copy_ has no float8 kernel on every device: copy the values as bytes
    data = cache.data.view(torch.uint8).view(2, nb * bs, hkv, d)
    scales = cache.scales.view(2, nb * bs, hkv)
    valid = slot_mapping >= 0
    idx = slot_mapping if bool(valid.all()) else slot_mapping[valid]
    for i, x in enumerate((k, v)):
        if idx.shape[0] != x.shape[0]:
            x = x[valid]
        q, s = quantize_rows(x, cache.data.dtype)
        data[i].index_copy_(0, idx, q.view(torch.uint8))
        scales[i].index_copy_(0, idx, s)


def gather_blocks(cache: KVCache, which: int, blocks: torch.Tensor) -> torch.Tensor:
    """K (which=0) or V (1) of the given blocks, [*blocks.shape, block_size, num_kv_heads, head_dim]: the cache's
    dtype when not quantized, dequantized to float32 otherwise."""
    if isinstance(cache, QuantizedKVCache):
        return dequantize_rows(cache.data[which][blocks], cache.scales[which][blocks])
    return cache[which][blocks]
