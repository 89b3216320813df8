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
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rooflm.kernels._utils import check_last_dim_contiguous, next_pow2


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cslot, stride_ch,  # the cache viewed as [num_blocks * block_size, num_kv_heads, head_dim]
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    dst = slot * stride_cslot + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


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
def _rotary_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, pos_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cslot, stride_ch, stride_cos,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    NEOX: tl.constexpr, WRITE_CACHE: tl.constexpr, PER_TOKEN: tl.constexpr,
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
            tl.store(base + i1[None, :], k1.to(kc_ptr.dtype.element_ty), mask=kmask)
            tl.store(base + i2[None, :], k2.to(kc_ptr.dtype.element_ty), mask=kmask)
            offs_d = tl.arange(0, HEAD_DIM_PAD)
            hmask = offs_kh[:, None] < NUM_KV_HEADS
            dst = slot * stride_cslot + offs_kh[:, None] * stride_ch + offs_d[None, :]
            if 2 * HALF < HEAD_DIM:  # partial rotary: the rest of k passes through
                tail = hmask & (offs_d[None, :] >= 2 * HALF) & (offs_d[None, :] < HEAD_DIM)
                kt = tl.load(k_ptr + t * stride_kt + offs_kh[:, None] * stride_kh + offs_d[None, :], mask=tail)
                tl.store(kc_ptr + dst, kt.to(kc_ptr.dtype.element_ty), mask=tail)
            vmask = hmask & (offs_d[None, :] < HEAD_DIM)
            v = tl.load(v_ptr + t * stride_vt + offs_kh[:, None] * stride_vh + offs_d[None, :], mask=vmask)
            tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=vmask)


def _cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _, nb, bs, hkv, d = kv_cache.shape
    check_last_dim_contiguous("kv_cache", kv_cache)
    if kv_cache[0].stride(0) != bs * kv_cache[0].stride(1):
        raise ValueError("kv_cache blocks must be laid out contiguously (slot = block * block_size + offset)")
    return kv_cache[0], kv_cache[1]


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter k, v [num_tokens, num_kv_heads, head_dim] into the cache at slot_mapping (-1 skipped)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    check_last_dim_contiguous("k", k)
    check_last_dim_contiguous("v", v)
    kc, vc = _cache_views(kv_cache)
    _write_kv_kernel[(num_tokens,)](
        k, v, kc, vc, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1), kc.stride(1), kc.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=next_pow2(num_kv_heads), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=next_pow2(head_dim), num_warps=4,
    )


def rotary_write_kv_cache(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor | None,  # [num_tokens]; None: cos/sin rows are per token already
    cos: torch.Tensor,  # [max_positions, rot_dim // 2] (or [num_tokens, rot_dim // 2] without positions)
    sin: torch.Tensor,
    kv_cache: torch.Tensor | None,  # None: rotate only
    slot_mapping: torch.Tensor | None,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = cos.shape[-1]
    if 2 * half > head_dim or sin.shape != cos.shape:
        raise ValueError(f"cos/sin {tuple(cos.shape)} / {tuple(sin.shape)} do not fit head_dim={head_dim}")
    if num_tokens == 0:
        return q, k
    for name, t in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin)):
        check_last_dim_contiguous(name, t)
    write = kv_cache is not None
    kc, vc = _cache_views(kv_cache) if write else (k, v)
    per_token = positions is None
    if per_token and cos.shape[0] < num_tokens:
        raise ValueError(f"cos/sin have {cos.shape[0]} rows for {num_tokens} tokens")
    pos_arg = cos if per_token else positions  # unused when per_token
    slots = slot_mapping if write else pos_arg
    _rotary_write_kv_kernel[(num_tokens,)](
        q, k, v, kc, vc, slots, pos_arg, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(1) if write else 0, kc.stride(2) if write else 0, cos.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, Q_HEADS_PAD=next_pow2(num_heads),
        KV_HEADS_PAD=next_pow2(num_kv_heads), HEAD_DIM=head_dim, HEAD_DIM_PAD=next_pow2(head_dim), HALF=half,
        HALF_PAD=next_pow2(half), NEOX=is_neox, WRITE_CACHE=write, PER_TOKEN=per_token,
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
