"""The one in-memory layout of a weight-only quantized matrix, shared by every source and every kernel.

Whatever a quantized weight came from -- round-to-nearest at load time, a GPTQ or AWQ checkpoint, a GGUF block
format -- it is converted once, at load time, into a ``PackedWeight``; the matmul kernels (Triton on the GPU, torch
on the CPU) read only this layout. One layout keeps the number of kernels small and makes every source testable
against the same reference, ``dequantize``.

Layout of an [N, K] weight (N = out_features rows, K = in_features columns, nn.Linear's orientation):

- ``bits == 8``: ``qweight`` int8 [N, K], signed codes in [-128, 127];
- ``bits == 4``: ``qweight`` uint8 [N, K // 2], unsigned codes in [0, 15]; byte j of a row holds column 2j in its
  low nibble and column 2j + 1 in its high nibble (the order llama.cpp's Q4 blocks and most CPU kernels use);
- ``scales`` [N, K // group_size] and ``mins`` [N, K // group_size] (or None), in the compute dtype; the weight is

      W[n, k] = q[n, k] * scales[n, k // group_size] + mins[n, k // group_size]      (mins None: + 0)

  This "scale and min" form covers both conventions in use: a symmetric code (``w = s * q``: int8 per channel,
  GGUF Q8_0, Q6_K) has no min, and a zero-point code (``w = s * (q - z)``: GPTQ, AWQ, GGUF Q4_0) has
  ``min = -s * z``; GGUF Q4_1 / Q4_K store exactly a scale and a min;
- ``group_size`` divides K; ``group_size == K`` is one scale per output channel;
- ``perm`` (GPTQ's act-order, ``desc_act``): None, or int64 [K] with stored column j multiplying input feature
  ``perm[j]``. Sorting the columns by group makes every group contiguous, so the kernels never see a ``g_idx``;
  the layer gathers ``x[:, perm]`` once per call instead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

SUPPORTED_BITS = (4, 8)


@dataclass
class PackedWeight:
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bits: int
    group_size: int
    perm: torch.Tensor | None = None
    # The same codes in the tensor-core GEMV's order (rooflm/kernels/quant_gemv_mma.py ``pack_mma``), or None: made
    # once where that kernel may run (CUDA, float16, 4 bits), a second copy of the codes beside ``qweight``.
    mma: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits={self.bits} is not supported: expected one of {SUPPORTED_BITS}")
        n, k = self.out_features, self.in_features
        want = torch.int8 if self.bits == 8 else torch.uint8
        if self.qweight.dtype != want or self.qweight.dim() != 2:
            raise ValueError(f"qweight must be a 2-D {want} tensor for bits={self.bits}, got "
                             f"{self.qweight.dtype} {tuple(self.qweight.shape)}")
        if self.group_size <= 0 or k % self.group_size:
            raise ValueError(f"group_size={self.group_size} does not divide in_features={k}")
        groups = (n, k // self.group_size)
        if tuple(self.scales.shape) != groups:
            raise ValueError(f"scales has shape {tuple(self.scales.shape)}, expected {groups}")
        if self.mins is not None and tuple(self.mins.shape) != groups:
            raise ValueError(f"mins has shape {tuple(self.mins.shape)}, expected {groups}")
        if self.perm is not None and tuple(self.perm.shape) != (k,):
            raise ValueError(f"perm has shape {tuple(self.perm.shape)}, expected ({k},)")

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * (2 if self.bits == 4 else 1)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (that of the scales)."""
        return self.scales.dtype

    @property
    def nbytes(self) -> int:
        """Bytes a matmul reads: codes, scales, mins (the roofline's weight traffic)."""
        tensors = [self.qweight, self.scales] + ([self.mins] if self.mins is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> PackedWeight:
        """Move to ``device``; ``dtype`` converts scales and mins (the codes never change)."""
        def mv(t: torch.Tensor | None, cast: bool) -> torch.Tensor | None:
            if t is None:
                return None
            return t.to(device=device, dtype=dtype if cast and dtype is not None else t.dtype)

        return replace(self, qweight=mv(self.qweight, False), scales=mv(self.scales, True), mins=mv(self.mins, True),
                       perm=mv(self.perm, False), mma=mv(self.mma, False))


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] integer codes in [0, 15] (K even) -> uint8 [N, K // 2], column 2j in the low nibble of byte j."""
    if codes.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even number of columns, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4``: uint8 [N, K // 2] -> uint8 codes [N, K]."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def codes(pw: PackedWeight) -> torch.Tensor:
    """The integer codes as int16 [N, K], in stored column order."""
    return (unpack_int4(pw.qweight) if pw.bits == 4 else pw.qweight).to(torch.int16)


def dequantize(pw: PackedWeight, dtype: torch.dtype | None = None, unpermute: bool = True) -> torch.Tensor:
    """The float weight [N, K] (the reference every kernel is tested against). Computed in float32 and cast to
    ``dtype`` (default: the scales' dtype). ``unpermute``: columns in input-feature order (undoing ``perm``);
    False keeps the stored order, which is what a kernel multiplies with ``x[:, perm]``."""
    q = codes(pw).float()
    s = pw.scales.float().repeat_interleave(pw.group_size, dim=1)
    w = q * s
    if pw.mins is not None:
        w = w + pw.mins.float().repeat_interleave(pw.group_size, dim=1)
    if unpermute and pw.perm is not None:
        out = torch.empty_like(w)
        out[:, pw.perm] = w
        w = out
    return w.to(dtype or pw.dtype)


def to_bits8(pw: PackedWeight) -> PackedWeight:
    """The same weight with 8-bit codes (exact): an int4 code q becomes q - 8 and the min grows by 8 * scale."""
    if pw.bits == 8:
        return pw
    q = (unpack_int4(pw.qweight).to(torch.int16) - 8).to(torch.int8)
    mins = pw.scales * 8 if pw.mins is None else pw.mins + pw.scales * 8
    return replace(pw, qweight=q, mins=mins, bits=8, mma=None)


def with_group_size(pw: PackedWeight, group_size: int) -> PackedWeight:
    """The same weight described with a smaller group size that divides the current one (scales repeated)."""
    if group_size == pw.group_size:
        return pw
    if pw.group_size % group_size:
        raise ValueError(f"group_size={group_size} does not divide the current group size {pw.group_size}")
    r = pw.group_size // group_size
    return replace(pw, group_size=group_size, scales=pw.scales.repeat_interleave(r, dim=1),
                   mins=None if pw.mins is None else pw.mins.repeat_interleave(r, dim=1))


def cat_rows(parts: list[PackedWeight]) -> PackedWeight:
    """Stack quantized shards along the output dimension (a fused projection: [q | k | v], [gate | up]).

    Shards stored with different bit widths or group sizes (a GGUF file may keep v_proj in Q6_K beside a Q4_K
    q_proj) are brought to the common form exactly: 8-bit codes when any shard has them, and the greatest common
    divisor of the group sizes. All shards must share ``perm`` (fused shards read the same input)."""
    if not parts:
        raise ValueError("cat_rows needs at least one shard")
    first = parts[0]
    for p in parts[1:]:
        if p.in_features != first.in_features:
            raise ValueError(f"cannot fuse shards with in_features {first.in_features} and {p.in_features}")
        if (p.perm is None) != (first.perm is None) or (p.perm is not None and not torch.equal(p.perm, first.perm)):
            raise ValueError("cannot fuse shards with different act-order permutations (g_idx)")
    bits = max(p.bits for p in parts)
    group = math.gcd(*(p.group_size for p in parts))
    parts = [with_group_size(to_bits8(p) if bits == 8 else p, group) for p in parts]
    any_min = any(p.mins is not None for p in parts)
    mins = None
    if any_min:
        mins = torch.cat([p.mins if p.mins is not None else torch.zeros_like(p.scales) for p in parts])
    return PackedWeight(qweight=torch.cat([p.qweight for p in parts]), scales=torch.cat([p.scales for p in parts]),
                        mins=mins, bits=bits, group_size=group, perm=first.perm)


def quant_linear_reference(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for a packed W: the twin every quantized matmul kernel is tested against. x [M, K] in the
    compute dtype; the weight is dequantized in stored column order and x gathered by ``perm``."""
    if pw.perm is not None:
        x = x[:, pw.perm]
    return torch.nn.functional.linear(x, dequantize(pw, dtype=x.dtype, unpermute=False), bias)
