# Writing new K/V into the paged cache, alone or fused with the rotary position embedding.
#
# Technique: RoPE (Su et al. 2021, "RoFormer") rotates each pair of a query/key head's first ``rot_dim`` dimensions
# by an angle pos * theta_i. Unfused, a layer reads q and k for the rotation, writes them, then reads k and v again to
# scatter them into the paged cache (PagedAttention, Kwon et al. 2023). Fused, one program per token reads q, k, v
# once, rotates q in place and k in registers, and writes the rotated k and v straight into the cache slot.
#
# Shapes and invariants:
#   q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim], each last dim contiguous
#   kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]; slot_mapping [num_tokens] int64,
#   slot = block * block_size + offset, -1 = do not write (padding)
#   cos, sin [max_positions, rot_dim // 2]; positions [num_tokens] int64
#   NEOX (Hugging Face's rotate_half, Llama/Mistral/Qwen2): pairs (x[i], x[i + rot_dim/2]);
#   otherwise GPT-J style interleaved pairs (x[2i], x[2i + 1]). Dimensions >= rot_dim pass through.
#   A quantized cache (QuantizedKVCache, kv_cache_dtype "int8" / "fp8"; see rooflm/attention/kv_quant.py) gets each
#   (token, KV head) row as round(x / s) with s = absmax(row) / QMAX, and s in its scales tensor
#   [2, num_blocks, block_size, num_kv_heads] at the same slot: the kernel holds a whole row of k (the rotated pairs
#   and any pass-through tail, each rounded to k's dtype first, as the reference quantizes them) and of v in
#   registers, so the absmax needs no second pass.
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rooflm.attention.kv_quant import QuantizedKVCache, qmax
from rooflm.kernels._utils import check_last_dim_contiguous, interpreting, next_pow2

# QUANT codes: no quantization, int8, fp8 e4m3 (cast by the hardware), fp8 e4m3 rounded to its grid in float32 first
# (Triton 3.9's CPU interpreter casts float32 -> e4m3 wrongly where rounding carries into the exponent, e.g. 124 ->
# 64 instead of 128; the values it then casts are exact. The compiled GPU path never uses it.)
_QUANT_NONE, _QUANT_INT8, _QUANT_FP8, _QUANT_FP8_ROUNDED = 0, 1, 2, 3


@triton.jit
def _round_e4m3(y):
    """y rounded to the nearest float8_e4m3fn value (ties to even), in float32 (|y| <= 448)."""
    a = tl.abs(y)
    e = tl.floor(tl.log2(tl.where(a > 0, a, 1.0)))
    e = tl.where(tl.exp2(e) > a, e - 1.0, e)  # log2 rounded up just below a power of two
    ulp = tl.exp2(tl.maximum(e, -6.0) - 3.0)  # 3 mantissa bits; subnormals below 2^-6 share 2^-9
    r = a / ulp
    f = tl.floor(r)
    d = r - f
    odd = f - 2.0 * tl.floor(f * 0.5)
    f = tl.where((d > 0.5) | ((d == 0.5) & (odd == 1.0)), f + 1.0, f)
    return tl.where(y < 0, -f * ulp, f * ulp)


@triton.jit
def _quantize(y, QUANT: tl.constexpr, QMAX: tl.constexpr):
    """y already divided by its row's scale -> the stored value (int8: nearest, halves up; fp8: nearest even)."""
    if QUANT == 1:
        r = tl.minimum(tl.maximum(tl.floor(y + 0.5), -QMAX), QMAX)
    elif QUANT == 2:
        r = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    else:
        r = _round_e4m3(tl.minimum(tl.maximum(y, -QMAX), QMAX))
    return r


@triton.jit
def _row_scale(amax, QMAX: tl.constexpr):
    """(scale to store, divisor): a row of zeros stores scale 0 and divides by 1."""
    scale = amax / QMAX
    return scale, tl.where(scale > 0, scale, 1.0)


@triton.jit
def _store_rows(x, c_ptr, dst, mask, s_ptr, sdst, smask, QUANT: tl.constexpr, QMAX: tl.constexpr):
    """Store rows x [heads, head_dim] at c_ptr + dst, quantized (and their scales at s_ptr + sdst) when QUANT."""
    if QUANT == 0:
        tl.store(c_ptr + dst, x.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        xf = tl.where(mask, x.to(tl.float32), 0.0)
        scale, div = _row_scale(tl.max(tl.abs(xf), 1), QMAX)
        tl.store(c_ptr + dst, _quantize(xf / div[:, None], QUANT, QMAX).to(c_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + sdst, scale, mask=smask)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cslot, stride_ch,  # the cache viewed as [num_blocks * block_size, num_kv_heads, head_dim]
    stride_sslot, stride_sh,  # the scales viewed as [num_blocks * block_size, num_kv_heads] (QUANT only)
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    QUANT: tl.constexpr, QMAX: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    dst = slot * stride_cslot + offs_h[:, None] * stride_ch + offs_d[None, :]
    sdst = slot * stride_sslot + offs_h * stride_sh
    smask = offs_h < NUM_KV_HEADS
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    _store_rows(k, kc_ptr, dst, mask, ks_ptr, sdst, smask, QUANT, QMAX)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    _store_rows(v, vc_ptr, dst, mask, vs_ptr, sdst, smask, QUANT, QMAX)


@triton.jit
def _rotate(x_ptr, row_stride, n_heads, offs_h, offs_r, cos, sin,
            HALF: tl.constexpr, NEOX: tl.constexpr):
    """Load the rotated pairs of rows x_ptr + h * row_stride, return them rotated in float32 (x1', x2')."""
    mask = (offs_h[:, None] < n_heads) & (offs_r[None, :] < HALF)
    if NEOX:
        i1 = offs_r
        i2 = offs_r + HALF
    else:
        i1 = 2 * offs_r
        i2 = 2 * offs_r + 1
    p1 = x_ptr + offs_h[:, None] * row_stride + i1[None, :]
    p2 = x_ptr + offs_h[:, None] * row_stride + i2[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos[None, :] - x2 * sin[None, :], x2 * cos[None, :] + x1 * sin[None, :], p1, p2, mask


@triton.jit
def rope_rows(base, offs, mask, cos, sin, HALF: tl.constexpr):
    """Rows ``base + offs`` rotated in float32 (rotate_half layout), each dimension d < 2 * HALF from d and its
    partner d +- HALF, the rest passed through; ``cos`` and ``sin`` hold angle d % HALF at position d (see
    ``rope_tables``). The same expressions as ``_rotate``, so the rounding equals this file's rotary kernel's."""
    lo = offs < HALF
    rot = offs < 2 * HALF
    x = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(base + tl.where(lo, offs + HALF, offs - HALF), mask=mask & rot, other=0.0).to(tl.float32)
    return tl.where(lo, x * cos - xp * sin, tl.where(rot, x * cos + xp * sin, x))


@triton.jit
def rope_tables(cos_row, sin_row, offs, HALF: tl.constexpr):
    """One token's angles spread over head_dim for ``rope_rows``: position d holds angle d % HALF (d < 2 * HALF)."""
    rot = offs < 2 * HALF
    r = tl.where(offs < HALF, offs, offs - HALF)
    cos = tl.load(cos_row + r, mask=rot, other=1.0).to(tl.float32)
    sin = tl.load(sin_row + r, mask=rot, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _rotary_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr, pos_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cslot, stride_ch, stride_sslot, stride_sh, stride_cos,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    NEOX: tl.constexpr, WRITE_CACHE: tl.constexpr, PER_TOKEN: tl.constexpr, QUANT: tl.constexpr, QMAX: tl.constexpr,
):
    t = tl.program_id(0)
    if PER_TOKEN:  # cos/sin already gathered: row t belongs to token t
        pos = t.to(tl.int64)
    else:
        pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_r = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_ptr + pos * stride_cos + offs_r, mask=offs_r < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + offs_r, mask=offs_r < HALF, other=0.0).to(tl.float32)

    # q: rotate in place.
    offs_qh = tl.arange(0, Q_HEADS_PAD)
    q1, q2, p1, p2, qmask = _rotate(q_ptr + t * stride_qt, stride_qh, NUM_HEADS, offs_qh, offs_r, cos, sin, HALF, NEOX)
    tl.store(p1, q1.to(q_ptr.dtype.element_ty), mask=qmask)
    tl.store(p2, q2.to(q_ptr.dtype.element_ty), mask=qmask)

    # k: rotate in place (the caller may read it), then copy k and v into the cache slot.
    offs_kh = tl.arange(0, KV_HEADS_PAD)
    k1, k2, p1, p2, kmask = _rotate(k_ptr + t * stride_kt, stride_kh, NUM_KV_HEADS, offs_kh, offs_r, cos, sin,
                                    HALF, NEOX)
    tl.store(p1, k1.to(k_ptr.dtype.element_ty), mask=kmask)
    tl.store(p2, k2.to(k_ptr.dtype.element_ty), mask=kmask)
    if WRITE_CACHE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            if NEOX:
                i1 = offs_r
                i2 = offs_r + HALF
            else:
                i1 = 2 * offs_r
                i2 = 2 * offs_r + 1
            base = kc_ptr + slot * stride_cslot + offs_kh[:, None] * stride_ch
            offs_d = tl.arange(0, HEAD_DIM_PAD)
            hmask = offs_kh[:, None] < NUM_KV_HEADS
            dst = slot * stride_cslot + offs_kh[:, None] * stride_ch + offs_d[None, :]
            sdst = slot * stride_sslot + offs_kh * stride_sh
            smask = offs_kh < NUM_KV_HEADS
            tail = hmask & (offs_d[None, :] >= 2 * HALF) & (offs_d[None, :] < HEAD_DIM)
            if 2 * HALF < HEAD_DIM:  # partial rotary: the rest of k passes through
                kt = tl.load(k_ptr + t * stride_kt + offs_kh[:, None] * stride_kh + offs_d[None, :], mask=tail,
                             other=0.0)
            else:
                kt = tl.zeros([KV_HEADS_PAD, HEAD_DIM_PAD], tl.float32)
            if QUANT == 0:
                tl.store(base + i1[None, :], k1.to(kc_ptr.dtype.element_ty), mask=kmask)
                tl.store(base + i2[None, :], k2.to(kc_ptr.dtype.element_ty), mask=kmask)
                if 2 * HALF < HEAD_DIM:
                    tl.store(kc_ptr + dst, kt.to(kc_ptr.dtype.element_ty), mask=tail)
            else:
                # quantize k as stored in k's dtype (what the reference quantizes); one absmax over the whole row
                r1 = tl.where(kmask, k1.to(k_ptr.dtype.element_ty).to(tl.float32), 0.0)
                r2 = tl.where(kmask, k2.to(k_ptr.dtype.element_ty).to(tl.float32), 0.0)
                rt = tl.where(tail, kt.to(tl.float32), 0.0)
                amax = tl.maximum(tl.maximum(tl.max(tl.abs(r1), 1), tl.max(tl.abs(r2), 1)), tl.max(tl.abs(rt), 1))
                scale, div = _row_scale(amax, QMAX)
                ty = kc_ptr.dtype.element_ty
                tl.store(base + i1[None, :], _quantize(r1 / div[:, None], QUANT, QMAX).to(ty), mask=kmask)
                tl.store(base + i2[None, :], _quantize(r2 / div[:, None], QUANT, QMAX).to(ty), mask=kmask)
                if 2 * HALF < HEAD_DIM:
                    tl.store(kc_ptr + dst, _quantize(rt / div[:, None], QUANT, QMAX).to(ty), mask=tail)
                tl.store(ks_ptr + sdst, scale, mask=smask)
            vmask = hmask & (offs_d[None, :] < HEAD_DIM)
            v = tl.load(v_ptr + t * stride_vt + offs_kh[:, None] * stride_vh + offs_d[None, :], mask=vmask)
            _store_rows(v, vc_ptr, dst, vmask, vs_ptr, sdst, smask, QUANT, QMAX)


def _cache_views(kv_cache: torch.Tensor | QuantizedKVCache):
    """(K values, V values, K scales, V scales, quantization code, QMAX); the scales are the values when the cache is
    not quantized (then never read)."""
    data = kv_cache.data if isinstance(kv_cache, QuantizedKVCache) else kv_cache
    _, nb, bs, hkv, d = data.shape
    check_last_dim_contiguous("kv_cache", data)
    if data[0].stride(0) != bs * data[0].stride(1):
        raise ValueError("kv_cache blocks must be laid out contiguously (slot = block * block_size + offset)")
    if not isinstance(kv_cache, QuantizedKVCache):
        return data[0], data[1], data[0], data[1], _QUANT_NONE, 1.0
    sc = kv_cache.scales
    if sc[0].stride(0) != bs * sc[0].stride(1):
        raise ValueError("kv_cache scales must be laid out contiguously (slot = block * block_size + offset)")
    code = _QUANT_INT8 if data.dtype == torch.int8 else _QUANT_FP8_ROUNDED if interpreting() else _QUANT_FP8
    return data[0], data[1], sc[0], sc[1], code, qmax(data.dtype)


def _scale_strides(ks: torch.Tensor, quant: int) -> tuple[int, int]:
    return (ks.stride(1), ks.stride(2)) if quant else (0, 0)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | QuantizedKVCache,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter k, v [num_tokens, num_kv_heads, head_dim] into the cache at slot_mapping (-1 skipped), quantized for
    a ``QuantizedKVCache``."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    check_last_dim_contiguous("k", k)
    check_last_dim_contiguous("v", v)
    kc, vc, ks, vs, quant, qm = _cache_views(kv_cache)
    _write_kv_kernel[(num_tokens,)](
        k, v, kc, vc, ks, vs, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1), kc.stride(1),
        kc.stride(2), *_scale_strides(ks, quant),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=next_pow2(num_kv_heads), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=next_pow2(head_dim), QUANT=quant, QMAX=qm, num_warps=4,
    )


def rotary_write_kv_cache(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor | None,  # [num_tokens]; None: cos/sin rows are per token already
    cos: torch.Tensor,  # [max_positions, rot_dim // 2] (or [num_tokens, rot_dim // 2] without positions)
    sin: torch.Tensor,
    kv_cache: torch.Tensor | QuantizedKVCache | None,  # None: rotate only
    slot_mapping: torch.Tensor | None,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = cos.shape[-1]
    if 2 * half > head_dim or sin.shape != cos.shape:
        raise ValueError(f"cos/sin {tuple(cos.shape)} / {tuple(sin.shape)} do not fit head_dim={head_dim}")
    if sin.stride(0) != cos.stride(0):  # the kernel steps both by cos's row stride
        raise ValueError(f"cos/sin row strides differ: {cos.stride(0)} / {sin.stride(0)}")
    if num_tokens == 0:
        return q, k
    for name, t in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin)):
        check_last_dim_contiguous(name, t)
    write = kv_cache is not None
    kc, vc, ks, vs, quant, qm = _cache_views(kv_cache) if write else (k, v, k, v, _QUANT_NONE, 1.0)
    per_token = positions is None
    if per_token and cos.shape[0] < num_tokens:
        raise ValueError(f"cos/sin have {cos.shape[0]} rows for {num_tokens} tokens")
    pos_arg = cos if per_token else positions  # unused when per_token
    slots = slot_mapping if write else pos_arg
    _rotary_write_kv_kernel[(num_tokens,)](
        q, k, v, kc, vc, ks, vs, slots, pos_arg, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(1) if write else 0, kc.stride(2) if write else 0, *_scale_strides(ks, quant), cos.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, Q_HEADS_PAD=next_pow2(num_heads),
        KV_HEADS_PAD=next_pow2(num_kv_heads), HEAD_DIM=head_dim, HEAD_DIM_PAD=next_pow2(head_dim), HALF=half,
        HALF_PAD=next_pow2(half), NEOX=is_neox, WRITE_CACHE=write, PER_TOKEN=per_token, QUANT=quant, QMAX=qm,
        num_warps=4,
    )
    return q, k


# ---------------------------------------------------------------------------------------------------------------------
# Torch twins
# ---------------------------------------------------------------------------------------------------------------------
def write_kv_cache_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    from rooflm.attention.backend import write_kv_cache as ref

    ref(k, v, kv_cache, slot_mapping)


def rotary_ref(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               is_neox: bool = True) -> torch.Tensor:
    """x [num_tokens, heads, head_dim] rotated in float32, returned in x's dtype (a new tensor)."""
    half = cos.shape[-1]
    rows = torch.arange(x.shape[0], device=x.device) if positions is None else positions.long()
    c = cos[rows].float()[:, None, :]
    s = sin[rows].float()[:, None, :]
    xf = x.float().clone()
    if is_neox:
        x1, x2 = xf[..., :half], xf[..., half : 2 * half]
    else:
        x1, x2 = xf[..., 0 : 2 * half : 2], xf[..., 1 : 2 * half : 2]
    r1, r2 = x1 * c - x2 * s, x2 * c + x1 * s
    if is_neox:
        xf[..., :half], xf[..., half : 2 * half] = r1, r2
    else:
        xf[..., 0 : 2 * half : 2], xf[..., 1 : 2 * half : 2] = r1, r2
    return xf.to(x.dtype)


def rotary_write_kv_cache_ref(q, k, v, positions, cos, sin, kv_cache, slot_mapping, is_neox=True):
    q2 = rotary_ref(q, positions, cos, sin, is_neox)
    k2 = rotary_ref(k, positions, cos, sin, is_neox)
    if kv_cache is not None:
        write_kv_cache_ref(k2, v, kv_cache, slot_mapping)
    return q2, k2
