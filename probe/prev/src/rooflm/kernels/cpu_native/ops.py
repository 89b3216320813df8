"""The float32 operators of ``ops.c`` (RMSNorm, decode-style attention, argmax) and ``decode.c``'s rotary embedding +
cache write, for the CPU path.

Every caller of an operator here, the module forward and the lean decoder loop alike, goes through ``native_ops()``,
so both paths pick the same implementation (the native one whenever the library is available, ``ROOFLM_CPU_NATIVE``
allowing) and so compute the same floats. Each function returns None when it does not take its input (not float32,
not on the CPU, no library); the caller then runs torch's operator.
"""
from __future__ import annotations

import ctypes

import torch

from rooflm.kernels.cpu_native.build import native_library


def native_ops() -> ctypes.CDLL | None:
    """The library when the native CPU operators are on (the same switch as the quantized matmul's), else None."""
    return native_library()


def _takes(*tensors: torch.Tensor) -> bool:
    for t in tensors:  # a loop, not all() over a generator: asked several times per layer
        if t.dtype != torch.float32 or t.device.type != "cpu":
            return False
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``x / sqrt(mean(x^2, -1) + eps) * weight`` over the last dimension, or None (see the module docstring)."""
    lib = native_ops()
    if lib is None or not _takes(x, weight) or weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        return None
    x = x.contiguous()
    w = weight.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    lib.ops_rms_norm(x.data_ptr(), w.data_ptr(), float(eps), out.data_ptr(), x.numel() // max(dim, 1), dim)
    return out


def argmax(x: torch.Tensor) -> torch.Tensor | None:
    """``x.max(dim=-1).indices`` for float32 x [R, N] (int64 [R]: the first of equal maxima, or the first NaN), or
    None (see the module docstring)."""
    lib = native_ops()
    if lib is None or x.dim() != 2 or not _takes(x) or x.shape[1] == 0 or x.stride(1) != 1:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.ops_argmax(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return out


def _rows(k: torch.Tensor) -> int | None:
    """Floats between consecutive positions of k [L, Hkv, D] when its heads and features are packed, else None."""
    _, hkv, d = k.shape
    return k.stride(0) if k.stride(2) == 1 and k.stride(1) == d else None


def _check_blocks(blocks: torch.Tensor, nkeys: list[int], block_size: int, num_blocks: int) -> None:
    """Raise ValueError unless every block index the tokens read is in [0, num_blocks): the whole table for one
    sequence, the first ceil(nkeys[t] / block_size) entries of row t for one row per token (a row's padding past its
    sequence is not read, so not checked)."""
    if blocks.dim() == 1:
        used = blocks
    else:
        needed = torch.tensor([-(-n // block_size) for n in nkeys])
        used = blocks[torch.arange(blocks.shape[1])[None, :] < needed[:, None]]
    if int(used.max()) >= num_blocks or int(used.min()) < 0:
        raise ValueError(f"blocks: block indices in [0, {num_blocks}) expected")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, nkeys: list[int],
           positions: torch.Tensor | None = None, blocks: torch.Tensor | None = None,
           block_size: int = 0, blocks_checked: bool = False) -> torch.Tensor | None:
    """Attention of T query tokens q [T, Hq, D] over k, v [L, Hkv, D] (position-major); token t reads the first
    ``nkeys[t]`` positions, or with ``positions`` (int64, the lists of all tokens one after another) the next
    ``nkeys[t]`` of them. With ``blocks`` (int64 block indices: one table, or [T, n] one row per token) k and v are a
    paged cache's planes [num_blocks * block_size, Hkv, D] and position p of token t lives at row ``table[p //
    block_size] * block_size + p % block_size``: read in place, without gathering the context. Every index a token
    reads is checked to lie in the cache unless ``blocks_checked`` (a caller that checked the table once a step).
    Returns [T, Hq, D], or None (see the module docstring)."""
    lib = native_ops()
    if lib is None or not _takes(q, k, v):
        return None
    rs = _rows(k)
    if rs is None or _rows(v) != rs:
        return None
    t, hq, d = q.shape
    hkv = k.shape[1]
    length = k.shape[0]
    blocks_ptr, stride = None, 0
    if blocks is not None:
        blocks = blocks.to(torch.int64).contiguous()
        if block_size < 1 or blocks.numel() == 0 or blocks.dim() not in (1, 2) or (
                blocks.dim() == 2 and blocks.shape[0] != t):
            raise ValueError(f"blocks: a table of block indices, or one row per token ({t}), and block_size >= 1 "
                             f"expected, got shape {tuple(blocks.shape)} and block_size={block_size}")
        num_blocks = length // block_size
        stride = blocks.shape[1] if blocks.dim() == 2 else 0
        length = blocks.shape[-1] * block_size
        if not blocks_checked and len(nkeys) == t and 1 <= min(nkeys, default=1) and max(nkeys, default=0) <= length:
            _check_blocks(blocks, nkeys, block_size, num_blocks)
        blocks_ptr = blocks.data_ptr()
    if len(nkeys) != t or min(nkeys, default=1) < 1 or max(nkeys, default=0) > length:
        raise ValueError(f"nkeys={nkeys}: expected {t} key counts in [1, {length}]")
    q = q.contiguous()
    out = torch.empty_like(q)
    counts = (ctypes.c_int64 * t)(*nkeys)
    pos = None
    if positions is not None:
        positions = positions.to(torch.int64).contiguous()
        if positions.numel() != sum(nkeys) or (positions.numel() and int(positions.max()) >= length):
            raise ValueError(f"positions: expected {sum(nkeys)} entries below {length}, got {positions.numel()}")
        pos = positions.data_ptr()
    rc = lib.ops_attend(q.data_ptr(), out.data_ptr(), t, hq, hkv, d, float(scale), k.data_ptr(), v.data_ptr(), rs,
                        counts, pos, blocks_ptr, block_size, stride, torch.get_num_threads())
    if rc:
        raise MemoryError(f"native attention failed (code {rc}) for {t} tokens over {max(nkeys)} keys")
    return out


def rope_write(qk: torch.Tensor, v: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor, kv_cache: torch.Tensor,
               slots: torch.Tensor) -> torch.Tensor | None:
    """Rotary embedding of qk [T, Hq + Hkv, D] (``x * cos2 + roll(x, D / 2) * sin2``, tables [T, 1, D]) and the write
    of the rotated K (the last Hkv heads) and of v [T, Hkv, D] to ``kv_cache`` [2, blocks, block size, Hkv, D] at
    ``slots`` (negative: not written). Returns the rotated heads [T, Hq + Hkv, D] (contiguous), or None (see the
    module docstring; also when the rows' heads are not packed or the cache is not contiguous)."""
    lib = native_ops()
    if lib is None or not _takes(qk, v, cos2, sin2, kv_cache) or not kv_cache.is_contiguous():
        return None
    t, heads, d = qk.shape
    hkv = v.shape[1]
    if (qk.stride(2) != 1 or qk.stride(1) != d or v.stride(2) != 1 or v.stride(1) != d or d % 2
            or kv_cache.shape[-2:] != (hkv, d) or cos2.numel() != t * d or sin2.numel() != t * d):
        return None
    cos2, sin2 = cos2.contiguous(), sin2.contiguous()
    slots = slots.to(torch.int64).contiguous()
    out = torch.empty(t, heads, d)
    lib.ops_rope_write(qk.data_ptr(), qk.stride(0), v.data_ptr(), v.stride(0), cos2.data_ptr(), sin2.data_ptr(), t,
                       heads - hkv, hkv, d, out.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
                       slots.data_ptr())
    return out
