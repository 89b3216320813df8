"""The GPTQ and AWQ checkpoint layouts of Hugging Face ``transformers`` / vLLM, read into and written from one
neutral form, ``IntQuant`` (integer codes, scales, integer zero points, ``g_idx``), and from there to the runtime
``PackedWeight``.

Both formats describe an nn.Linear weight W [N, K] (N = out_features, K = in_features) as

    W[n, k] = scales[g, n] * (q[n, k] - z[g, n]),    g = g_idx[k]

with unsigned codes q in [0, 2^bits) packed into int32 words, lowest bits first:

- GPTQ (``quant_method: "gptq"``, Frantar et al. 2023; AutoGPTQ / GPTQModel layout), 4 or 8 bits:
  ``qweight`` int32 [K * bits / 32, N]: word (i, n) holds q[n, i * 32 / bits + j] in bits [j * bits, (j + 1) * bits)
  (packed along the input dimension); ``qzeros`` int32 [G, N * bits / 32]: word (g, i) holds the zero of output
  column i * 32 / bits + j in the same bit positions (packed along N); ``scales`` fp16 [G, N]; ``g_idx`` int32 [K],
  the group of each input feature (not sorted when the checkpoint was made with act-order, ``desc_act``).
  ``checkpoint_format: "gptq"`` (the classic, and what every reader expects) stores z - 1 in qzeros and readers add
  the 1 back without wrapping, so a zero point of 0 cannot be written (it would read back as 2^bits);
  ``"gptq_v2"`` (GPTQModel's internal format) stores z itself.
- AWQ GEMM (``quant_method: "awq"``, ``version: "gemm"``, Lin et al. 2024), 4 bits: ``qweight`` int32 [K, N / 8]
  packed along the OUTPUT dimension, the 8 nibbles of a word holding output columns [0, 2, 4, 6, 1, 3, 5, 7] of its
  group of eight (nibble j holds column ``AWQ_ORDER[j]``: the order the GEMM kernel dequantizes in); ``qzeros`` int32
  [G, N / 8] in the same order, storing z itself; ``scales`` fp16 [G, N]; no g_idx (groups are contiguous).

``PackedWeight`` needs contiguous groups: a g_idx that is not ``k // group_size`` becomes ``perm = argsort(g_idx)``
(stable), the columns stored in that order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rooflm.quantization.packed import PackedWeight, codes as packed_codes, pack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
GPTQ_CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


@dataclass
class IntQuant:
    """A zero-point quantized [N, K] weight in input-feature order: ``W[n, k] = scales[n, g] * (codes[n, k] -
    zeros[n, g])`` with ``g = g_idx[k]``. codes int16 [N, K] in [0, 2^bits); scales float [N, G]; zeros int16 [N, G];
    g_idx int64 [K] or None (``k // group_size``)."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group_size: int
    g_idx: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits={self.bits} is not supported: expected 4 or 8")
        n, k = self.codes.shape
        if self.group_size <= 0 or k % self.group_size:
            raise ValueError(f"group_size={self.group_size} does not divide in_features={k}")
        groups = (n, k // self.group_size)
        for name in ("scales", "zeros"):
            if tuple(getattr(self, name).shape) != groups:
                raise ValueError(f"{name} has shape {tuple(getattr(self, name).shape)}, expected {groups}")
        if self.g_idx is not None and tuple(self.g_idx.shape) != (k,):
            raise ValueError(f"g_idx has shape {tuple(self.g_idx.shape)}, expected ({k},)")

    @property
    def group_index(self) -> torch.Tensor:
        """g_idx, with the default ``k // group_size`` filled in."""
        if self.g_idx is not None:
            return self.g_idx.long()
        k = self.codes.shape[1]
        return torch.arange(k, device=self.codes.device) // self.group_size

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K]."""
        g = self.group_index
        return self.scales.float()[:, g] * (self.codes.float() - self.zeros.float()[:, g])

    def to_packed(self, dtype: torch.dtype) -> PackedWeight:
        """The runtime layout (scales and mins in ``dtype``). 8-bit codes become signed (q - 128, the min growing by
        128 * scale); a weight whose zero points are all 2^(bits-1) at 8 bits is symmetric and gets no mins."""
        perm = group_permutation(self.g_idx, self.codes.shape[1], self.group_size)
        q = self.codes if perm is None else self.codes[:, perm]
        z = self.zeros.float()
        s = self.scales.float()
        if self.bits == 4:
            return PackedWeight(qweight=pack_int4(q), scales=s.to(dtype), mins=(-s * z).to(dtype), bits=4,
                                group_size=self.group_size, perm=perm)
        mins = None if bool((self.zeros == 128).all()) else (s * (128 - z)).to(dtype)
        return PackedWeight(qweight=(q.to(torch.int16) - 128).to(torch.int8), scales=s.to(dtype), mins=mins, bits=8,
                            group_size=self.group_size, perm=perm)


def group_permutation(g_idx: torch.Tensor | None, k: int, group_size: int) -> torch.Tensor | None:
    """None when g_idx is ``k // group_size`` (or None); else ``argsort(g_idx, stable)``, after checking that every
    group has exactly ``group_size`` members (what a contiguous-group layout needs)."""
    if g_idx is None:
        return None
    g = g_idx.long()
    default = torch.arange(k, device=g.device) // group_size
    if torch.equal(g, default):
        return None
    counts = torch.bincount(g, minlength=k // group_size) if g.numel() and g.min() >= 0 else None
    if counts is None or counts.numel() != k // group_size or bool((counts != group_size).any()):
        raise ValueError(f"g_idx does not assign exactly group_size={group_size} input features to each of the "
                         f"{k // group_size} groups")
    return torch.argsort(g, stable=True)


def from_packed(pw: PackedWeight) -> IntQuant:
    """The inverse of ``IntQuant.to_packed``. Zero points are recovered as ``-mins / scales`` (8-bit: ``128 +
    ...``) and must be integers: a weight whose mins are not integer multiples of its scales (GGUF Q4_1 / Q4_K)
    has no zero-point form and raises ValueError."""
    s = pw.scales.float()
    m = torch.zeros_like(s) if pw.mins is None else pw.mins.float()
    q = packed_codes(pw)
    offset = 0 if pw.bits == 4 else 128
    zf = offset - m / s
    z = torch.round(zf)
    if bool(((zf - z).abs() > 0.05).any()) or bool((z < 0).any()) or bool((z > 2 ** pw.bits).any()):
        raise ValueError("mins are not integer multiples of -scales: this weight has no integer zero point "
                         "(e.g. a GGUF Q4_1 / Q4_K weight) and cannot be written in the GPTQ or AWQ format")
    q = q + offset
    g_idx = None
    if pw.perm is not None:
        inv = torch.empty_like(pw.perm)
        inv[pw.perm] = torch.arange(pw.perm.numel(), device=pw.perm.device)
        q = q[:, inv]
        g_idx = inv // pw.group_size  # input feature perm[j] sits in stored column j, group j // group_size
    return IntQuant(codes=q.to(torch.int16), scales=s, zeros=z.to(torch.int16), bits=pw.bits,
                    group_size=pw.group_size, g_idx=g_idx)


# --- bit packing -----------------------------------------------------------------------------------------------

def pack_words(values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Pack unsigned ``bits``-bit integers along ``dim`` into int32 words, 32 / bits per word, field j (bits
    [j * bits, (j + 1) * bits)) holding element ``order[j]`` of each run (default: element j)."""
    per = 32 // bits
    v = values.movedim(dim, -1).to(torch.int64) & (2 ** bits - 1)
    if v.shape[-1] % per:
        raise ValueError(f"cannot pack {v.shape[-1]} values of {bits} bits into 32-bit words: not a multiple of {per}")
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)
    if order is not None:
        v = v[..., list(order)]
    shifts = torch.arange(per, device=v.device, dtype=torch.int64) * bits
    word = (v << shifts).sum(-1)  # disjoint bit fields: the sum is the bitwise or
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)
    return word.movedim(-1, dim)


def unpack_words(words: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Inverse of ``pack_words``: int32 words -> int16 values, ``32 / bits`` times as many along ``dim``."""
    if words.dtype != torch.int32:
        raise ValueError(f"packed words must be int32, got {words.dtype}")
    per = 32 // bits
    w = words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, device=w.device, dtype=torch.int64) * bits
    fields = (w.unsqueeze(-1) >> shifts) & (2 ** bits - 1)  # [..., words, per]: field j
    if order is not None:
        out = torch.empty_like(fields)
        out[..., list(order)] = fields  # element order[j] came from field j
        fields = out
    return fields.flatten(-2).to(torch.int16).movedim(-1, dim)


# --- GPTQ ------------------------------------------------------------------------------------------------------

def _check_checkpoint_format(checkpoint_format: str) -> int:
    if checkpoint_format not in GPTQ_CHECKPOINT_FORMATS:
        raise ValueError(f"checkpoint_format={checkpoint_format!r} is not supported: expected one of "
                         f"{GPTQ_CHECKPOINT_FORMATS}")
    return 1 if checkpoint_format == "gptq" else 0


def to_gptq(q: IntQuant, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """The GPTQ tensors ``qweight``, ``qzeros``, ``scales`` (fp16) and ``g_idx`` of a weight."""
    offset = _check_checkpoint_format(checkpoint_format)
    if offset and bool((q.zeros < offset).any()):
        raise ValueError("a zero point of 0 cannot be stored in checkpoint_format='gptq' (it stores z - 1 and readers "
                         "do not wrap): quantize with min_zero=1 or write checkpoint_format='gptq_v2'")
    return {
        "qweight": pack_words(q.codes.t(), q.bits, dim=0),
        "qzeros": pack_words((q.zeros - offset).t(), q.bits, dim=1),
        "scales": q.scales.t().to(torch.float16).contiguous(),
        "g_idx": q.group_index.to(torch.int32),
    }


def _check_groups(qweight: torch.Tensor, scales: torch.Tensor, k: int, n: int, group_size: int,
                  what: str) -> tuple[int, int]:
    """(group_size, number of groups) of a [k, n] checkpoint weight after checking ``group_size`` (-1: k) and the
    ``scales`` shape; ValueError naming the field."""
    group_size = k if group_size == -1 else group_size
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size={group_size} does not divide in_features={k} (from qweight "
                         f"{tuple(qweight.shape)})")
    groups = k // group_size
    if tuple(scales.shape) != (groups, n):
        raise ValueError(f"scales has shape {tuple(scales.shape)}, expected {(groups, n)} for qweight "
                         f"{tuple(qweight.shape)} with {what}group_size={group_size}")
    return group_size, groups


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
              bits: int, group_size: int, checkpoint_format: str = "gptq") -> IntQuant:
    """Unpack GPTQ tensors (shapes checked; ValueError naming the tensor). ``group_size`` -1 means in_features."""
    offset = _check_checkpoint_format(checkpoint_format)
    if bits not in (4, 8):
        raise ValueError(f"bits={bits} is not supported for GPTQ: expected 4 or 8")
    per = 32 // bits
    if qweight.dim() != 2 or scales.dim() != 2:
        raise ValueError(f"qweight and scales must be 2-D, got {tuple(qweight.shape)} and {tuple(scales.shape)}")
    k, n = qweight.shape[0] * per, qweight.shape[1]
    group_size, groups = _check_groups(qweight, scales, k, n, group_size, f"bits={bits}, ")
    if n % per or tuple(qzeros.shape) != (groups, n // per):
        raise ValueError(f"qzeros has shape {tuple(qzeros.shape)}, expected {(groups, n // per)}")
    if g_idx is not None and tuple(g_idx.shape) != (k,):
        raise ValueError(f"g_idx has shape {tuple(g_idx.shape)}, expected ({k},)")
    codes = unpack_words(qweight, bits, dim=0).t()
    zeros = (unpack_words(qzeros, bits, dim=1) + offset).t()
    if g_idx is not None and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
        raise ValueError(f"g_idx values must lie in [0, {groups}), got [{int(g_idx.min())}, {int(g_idx.max())}]")
    return IntQuant(codes=codes.contiguous(), scales=scales.t().float().contiguous(), zeros=zeros.contiguous(),
                    bits=bits, group_size=group_size, g_idx=None if g_idx is None else g_idx.long())


def gptq_to_packed(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                   bits: int, group_size: int, dtype: torch.dtype, checkpoint_format: str = "gptq") -> PackedWeight:
    return from_gptq(qweight, qzeros, scales, g_idx, bits, group_size, checkpoint_format).to_packed(dtype)


def packed_to_gptq(pw: PackedWeight, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    return to_gptq(from_packed(pw), checkpoint_format)


# --- AWQ -------------------------------------------------------------------------------------------------------

def to_awq(q: IntQuant) -> dict[str, torch.Tensor]:
    """The AWQ GEMM tensors ``qweight``, ``qzeros`` and ``scales`` (fp16) of a 4-bit weight with contiguous
    groups."""
    if q.bits != 4:
        raise ValueError(f"bits={q.bits} is not supported by the AWQ format: expected 4")
    if group_permutation(q.g_idx, q.codes.shape[1], q.group_size) is not None:
        raise ValueError("the AWQ format has no g_idx: an act-order (desc_act) weight can only be written as GPTQ")
    return {
        "qweight": pack_words(q.codes.t(), 4, dim=1, order=AWQ_ORDER),
        "qzeros": pack_words(q.zeros.t(), 4, dim=1, order=AWQ_ORDER),
        "scales": q.scales.t().to(torch.float16).contiguous(),
    }


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, bits: int,
             group_size: int) -> IntQuant:
    """Unpack AWQ GEMM tensors (shapes checked; ValueError naming the tensor)."""
    if bits != 4:
        raise ValueError(f"bits={bits} is not supported by the AWQ format: expected 4")
    if qweight.dim() != 2 or scales.dim() != 2:
        raise ValueError(f"qweight and scales must be 2-D, got {tuple(qweight.shape)} and {tuple(scales.shape)}")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    group_size, groups = _check_groups(qweight, scales, k, n, group_size, "")
    if tuple(qzeros.shape) != (groups, n // 8):
        raise ValueError(f"qzeros has shape {tuple(qzeros.shape)}, expected {(groups, n // 8)}")
    codes = unpack_words(qweight, 4, dim=1, order=AWQ_ORDER).t()
    zeros = unpack_words(qzeros, 4, dim=1, order=AWQ_ORDER).t()
    return IntQuant(codes=codes.contiguous(), scales=scales.t().float().contiguous(), zeros=zeros.contiguous(),
                    bits=4, group_size=group_size)


def awq_to_packed(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
                  dtype: torch.dtype) -> PackedWeight:
    return from_awq(qweight, qzeros, scales, bits, group_size).to_packed(dtype)


def packed_to_awq(pw: PackedWeight) -> dict[str, torch.Tensor]:
    return to_awq(from_packed(pw))
