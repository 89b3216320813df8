"""llama.cpp's GGUF block formats rewritten, without dequantizing, into the packed layout (``packed.PackedWeight``).

Every supported format stores, per block of weights along a row, integer codes and one or two fp16 numbers, and
decodes as ``w = scale * q + min`` with a scale and a min per group of 16 or 32 consecutive weights. Repacking
therefore only moves bits: the codes are re-ordered into packed.py's nibble order and the per-group scales and mins
are computed once (in float32, the precision llama.cpp and the ``gguf`` package decode in) and cast to the compute
dtype. The products that form them (``d * sc`` with a 6- or 8-bit ``sc``) are exact in float32, so
``packed.dequantize`` of the result reproduces ``gguf.quants.dequantize`` bit for bit in float32; a float16 or
bfloat16 compute dtype adds only the rounding of that cast.

Block layouts (``ggml-common.h``; d, dmin, m are fp16; byte ``i`` of a "nibble" array holds two 4-bit codes):

- ``Q4_0`` (32 weights, 18 bytes): d, 16 bytes of nibbles; weight i < 16 is the low nibble of byte i, weight
  16 + i its high nibble; ``w = d * (q - 8)`` -> 4-bit codes, group 32, scale d, min -8d.
- ``Q4_1`` (32, 20): d, m, nibbles as Q4_0; ``w = d * q + m`` -> 4-bit, group 32, scale d, min m.
- ``Q8_0`` (32, 34): d, 32 int8 codes; ``w = d * q`` -> 8-bit, group 32, no min.
- ``Q4_K`` (256, 144): d, dmin, 12 bytes holding eight 6-bit sub-block scales ``sc`` and mins ``m``, 128 bytes of
  nibbles in four runs of 32 bytes, run j holding sub-block 2j in its low and 2j + 1 in its high nibbles;
  ``w = d * sc * q - dmin * m`` -> 4-bit, group 32, scale d * sc, min -dmin * m.
- ``Q5_K`` (256, 176): as Q4_K plus 32 bytes ``qh`` whose bit s of byte l is the fifth bit of weight 32 s + l;
  q in [0, 31] -> 8-bit codes q (unsigned values fit int8), group 32, scale d * sc, min -dmin * m. Keeping q
  uncentred keeps the decode in ggml's operation order (one rounding), hence exact.
- ``Q6_K`` (256, 210): 128 bytes low nibbles, 64 bytes of 2-bit high parts, 16 int8 sub-block scales, d;
  ``w = d * sc * (q - 32)`` -> 8-bit codes q - 32, group 16, scale d * sc, no min.

F32, F16 and BF16 tensors stay float (``gguf_to_packed`` returns None). The remaining formats (Q2_K, Q3_K, Q5_0,
Q5_1, the IQ and ternary types) raise ``UnsupportedGGUFType``: a loader falls back to dequantizing those tensors.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from rooflm.quantization.packed import PackedWeight

Q = GGMLQuantizationType
FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})
REPACKABLE_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K})
COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class UnsupportedGGUFType(NotImplementedError):
    """A GGUF block format with no exact packed form; the tensor has to be dequantized to float instead."""

    def __init__(self, ggml_type: GGMLQuantizationType) -> None:
        super().__init__(f"GGUF type {ggml_type.name} cannot be repacked into the packed int4/int8 layout")
        self.ggml_type = ggml_type


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 at byte ``offset`` of every block, as float32 [N, n_blocks]."""
    return np.ascontiguousarray(blocks[..., offset:offset + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return qs & np.uint8(0x0F), qs >> np.uint8(4)


def _pack_pairs(codes: np.ndarray, n: int) -> np.ndarray:
    """uint8 codes in [0, 15], weights in row order -> [N, K // 2] bytes, column 2j low nibble, 2j + 1 high."""
    c = codes.reshape(n, -1)
    return c[:, 0::2] | (c[:, 1::2] << np.uint8(4))


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit (scale, min) pairs of a Q4_K / Q5_K super-block from its 12 bytes [..., 12].

    Bytes 0-3 hold the scales of sub-blocks 0-3 in their low 6 bits, bytes 4-7 the mins of 0-3; sub-blocks 4-7
    take their low 4 bits from bytes 8-11 (scale low nibble, min high nibble) and their top 2 bits from the top
    bits of bytes 0-3 (scales) and 4-7 (mins)."""
    lo_sc, lo_m, mix = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo_sc & 63, (mix & 0x0F) | ((lo_sc >> 6) << 4)], axis=-1)
    mn = np.concatenate([lo_m & 63, (mix >> 4) | ((lo_m >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_0(b: np.ndarray, n: int):
    lo, hi = _nibbles(b[..., 2:18])
    d = _f16(b, 0)
    return 4, 32, _pack_pairs(np.concatenate([lo, hi], axis=-1), n), d, d * np.float32(-8.0)


def _q4_1(b: np.ndarray, n: int):
    lo, hi = _nibbles(b[..., 4:20])
    return 4, 32, _pack_pairs(np.concatenate([lo, hi], axis=-1), n), _f16(b, 0), _f16(b, 2)


def _q8_0(b: np.ndarray, n: int):
    return 8, 32, np.ascontiguousarray(b[..., 2:34]).view(np.int8).reshape(n, -1), _f16(b, 0), None


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-sub-block scale d * sc and min -dmin * m of Q4_K / Q5_K blocks, [N, n_blocks * 8]."""
    sc, mn = _k_scale_min(b[..., 4:16])
    scale = _f16(b, 0)[..., None] * sc
    mins = -(_f16(b, 2)[..., None] * mn)
    return scale.reshape(scale.shape[0], -1), mins.reshape(mins.shape[0], -1)


def _q4_k(b: np.ndarray, n: int):
    lo, hi = _nibbles(b[..., 16:144].reshape(n, -1, 4, 1, 32))
    codes = np.concatenate([lo, hi], axis=-2)  # [N, blocks, run j, (sub-block 2j, 2j + 1), 32]
    return (4, 32, _pack_pairs(codes, n), *_k_scales(b))


def _q5_k(b: np.ndarray, n: int):
    lo, hi = _nibbles(b[..., 48:176].reshape(n, -1, 4, 1, 32))
    low4 = np.concatenate([lo, hi], axis=-2).reshape(n, -1, 8, 32)
    shifts = np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    high = (b[..., 16:48].reshape(n, -1, 1, 32) >> shifts) & np.uint8(1)
    codes = (low4 | (high << np.uint8(4))).astype(np.int8)
    return (8, 32, codes.reshape(n, -1), *_k_scales(b))


def _q6_k(b: np.ndarray, n: int):
    lo, hi = _nibbles(b[..., 0:128].reshape(n, -1, 2, 1, 64))
    low4 = np.concatenate([lo, hi], axis=-2).reshape(n, -1, 2, 4, 32)  # weight 128 h + 64 nib + l
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    high = (b[..., 128:192].reshape(n, -1, 2, 1, 32) >> shifts) & np.uint8(3)  # weight 128 h + 32 s + l
    codes = (low4 | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    scale = _f16(b, 208)[..., None] * sc
    return 8, 16, codes.reshape(n, -1), scale.reshape(n, -1), None


_DECODERS = {Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q8_0: _q8_0, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k}


def as_ggml_type(ggml_type: GGMLQuantizationType | int) -> GGMLQuantizationType:
    try:
        return Q(int(ggml_type))
    except ValueError:
        raise ValueError(f"ggml_type={ggml_type!r} is not a GGML tensor type") from None


def is_repackable(ggml_type: GGMLQuantizationType | int) -> bool:
    """Whether ``gguf_to_packed`` turns tensors of this type into a PackedWeight."""
    return as_ggml_type(ggml_type) in REPACKABLE_TYPES


def gguf_to_packed(data: np.ndarray, ggml_type: GGMLQuantizationType | int, shape: Sequence[int],
                   dtype: torch.dtype = torch.float32) -> PackedWeight | None:
    """One GGUF tensor's raw block bytes -> PackedWeight, with no change to any weight.

    ``data``: the bytes as ``GGUFReader`` gives them (uint8 [N, bytes per row] or flat); ``shape``: the tensor's
    torch shape [N, K] (GGUF's dimension list reversed); ``dtype``: compute dtype of the scales and mins (computed
    in float32, cast once). Returns None for F32 / F16 / BF16 (the tensor stays float); raises
    ``UnsupportedGGUFType`` for block formats without an exact packed form, ValueError for inconsistent input."""
    qtype = as_ggml_type(ggml_type)
    if qtype in FLOAT_TYPES:
        return None
    if qtype not in _DECODERS:
        raise UnsupportedGGUFType(qtype)
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype={dtype} is not a compute dtype: expected one of {COMPUTE_DTYPES}")
    shape = tuple(int(s) for s in shape)
    if len(shape) != 2 or min(shape) <= 0:
        raise ValueError(f"shape={shape} must be a 2-D [out_features, in_features] shape")
    n, k = shape
    block, type_size = GGML_QUANT_SIZES[qtype]
    if k % block:
        raise ValueError(f"shape={shape}: in_features {k} is not a multiple of the {qtype.name} block size {block}")
    data = np.asarray(data)
    if data.dtype != np.uint8:
        raise ValueError(f"data has dtype {data.dtype}; {qtype.name} tensors are raw uint8 block bytes")
    if data.size != n * (k // block) * type_size:
        raise ValueError(f"data has {data.size} bytes; a {qtype.name} tensor of shape {shape} has "
                         f"{n * (k // block) * type_size}")
    blocks = np.ascontiguousarray(data).reshape(n, k // block, type_size)
    bits, group, qweight, scales, mins = _DECODERS[qtype](blocks, n)

    def tensor(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a).reshape(n, -1))

    return PackedWeight(qweight=tensor(qweight), scales=tensor(scales).to(dtype),
                        mins=None if mins is None else tensor(mins).to(dtype), bits=bits, group_size=group)
