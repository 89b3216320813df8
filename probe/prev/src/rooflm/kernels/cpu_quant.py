"""Weight-only quantized matmul on the CPU through torch's packed integer kernels.

A batch-1 decode step on a CPU is bound by the bytes of weights it reads, like on a GPU: SmolLM2-135M reads 540 MB
per token in float32, 67 MB in 4 bits. torch ships two CPU kernels that read packed integer weights directly and
vectorise with AVX-512 / AMX where the CPU has them (both fast only for bfloat16 activations; in float32 and float16
they fall back to scalar loops that are 10-50x slower on this project's test machine):

- ``_weight_int4pack_mm_for_cpu``: 4-bit codes with a bf16 (scale, zero) pair per group of 32/64/128/256 input
  columns; it computes ``W = (q - 8) * scale + zero``;
- ``_weight_int8pack_mm``: int8 codes with one scale per output row.

``prepare_cpu`` converts a ``PackedWeight`` once (at load time) into the form one of them reads:

- 4-bit codes: ``zero = min + 8 * scale`` (exact in float32, then rounded to bfloat16 like the scale);
- 8-bit codes, one group per row, no min: the int8 kernel as it is;
- 8-bit codes in groups of >= 32 (GGUF Q8_0, Q5_K; GPTQ 8-bit): there is no grouped int8 kernel, so each code is
  split exactly into two 4-bit halves, ``q = 16 * h + l`` with ``h`` in [-8, 7] and ``l`` in [0, 15], i.e.
  ``W = (h' - 8) * 16 s + (l - 8) * s + (8 s + min)`` with ``h' = h + 8``; both halves go through ONE int4 call as
  2N output rows and the two halves of the result are added. It reads 10 bits a weight (two 4-bit codes plus two
  bf16 pairs per 32) instead of 16 for a dequantized bf16 copy;
- anything else (groups of 16 such as GGUF Q6_K, an output size that is not a multiple of 16): dequantized once to
  bfloat16 and multiplied with ``F.linear``.

Before all of these, when the native kernel (``rooflm.kernels.cpu_native``: 4- and 8-bit codes in groups of a
multiple of 32, activations quantized to int8 per block of 32 as llama.cpp does) builds on this machine and
``ROOFLM_CPU_NATIVE`` is not ``off``, a weight it takes goes to it instead (kind ``"native"``): it reads the weights
once for all the rows of a call, where torch's int4 kernel costs about proportionally to the rows.

Activations are cast to bfloat16 for the product and the result back to the caller's dtype, so a float32 model keeps
its residual stream in float32. bfloat16 keeps 8 significant bits: the logits of a quantized LM head carry an error
of about 0.4% of their magnitude (the perplexity table in docs/quantization.md measures the effect).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rooflm.kernels.cpu_native import (
    NativeWeight,
    native_library,
    native_linear,
    native_supports,
    pack_native,
)
from rooflm.quantization.packed import PackedWeight, codes, dequantize

INT4_GROUP_SIZES = (32, 64, 128, 256)
COMPUTE_DTYPE = torch.bfloat16


@dataclass
class CpuQuantWeight:
    """A weight in the form one of torch's CPU kernels reads (see the module docstring)."""

    kind: str  # "native" | "int4" | "int8" | "dense"
    weight: torch.Tensor  # int4: torch's packed tensor; int8: int8 [N, K]; dense: bf16 [N, K]
    scales: torch.Tensor | None  # int4: bf16 [K / group, rows, 2] (scale, zero); int8: bf16 [N]; dense: None
    group_size: int
    out_features: int
    split: bool = False  # int8 codes run as two int4 halves stacked on the output rows
    perm: torch.Tensor | None = None
    native: NativeWeight | None = None  # kind "native": the weight in the native kernel's layout

    @property
    def nbytes(self) -> int:
        if self.native is not None:
            return self.native.nbytes
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scales) if t is not None)


def _int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
    """codes [R, K] in [0, 15], float32 scales / zeros [R, K / g] -> (packed, bf16 [K / g, R, 2])."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    sz = torch.stack((scales.t(), zeros.t()), dim=-1).to(COMPUTE_DTYPE).contiguous()
    return packed, sz


def prepare_cpu(pw: PackedWeight) -> CpuQuantWeight:
    """Convert once; the result is what ``quant_linear_cpu`` multiplies with."""
    n, k = pw.out_features, pw.in_features
    g = pw.group_size
    scales = pw.scales.float()
    mins = pw.mins.float() if pw.mins is not None else torch.zeros_like(scales)
    lib = native_library() if native_supports(pw) else None
    if lib is not None:
        nw = pack_native(pw, lib)
        return CpuQuantWeight("native", nw.codes, nw.scales, g, n, perm=pw.perm, native=nw)
    int4_ok = g in INT4_GROUP_SIZES and n % 16 == 0 and k % g == 0
    if pw.bits == 4 and int4_ok:
        packed, sz = _int4(codes(pw), scales, mins + 8 * scales, g)
        return CpuQuantWeight("int4", packed, sz, g, n, perm=pw.perm)
    if pw.bits == 8 and g == k and pw.mins is None:
        return CpuQuantWeight("int8", pw.qweight.contiguous(), pw.scales[:, 0].to(COMPUTE_DTYPE).contiguous(), g, n,
                              perm=pw.perm)
    if pw.bits == 8 and int4_ok:
        q = codes(pw)  # int16 in [-128, 127]
        hi = torch.div(q, 16, rounding_mode="floor")  # [-8, 7]
        lo = q - 16 * hi  # [0, 15]
        rows = torch.cat((hi + 8, lo))
        packed, sz = _int4(rows, torch.cat((16 * scales, scales)),
                           torch.cat((torch.zeros_like(scales), mins + 8 * scales)), g)
        return CpuQuantWeight("int4", packed, sz, g, n, split=True, perm=pw.perm)
    w = dequantize(pw, dtype=COMPUTE_DTYPE, unpermute=False).contiguous()
    return CpuQuantWeight("dense", w, None, g, n, perm=pw.perm)


def quant_linear_cpu(x: torch.Tensor, w: CpuQuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for x [M, K] in any float dtype; the result in x's dtype."""
    dtype = x.dtype
    if w.perm is not None:
        x = x[:, w.perm]
    if w.kind == "native":
        y = native_linear(x, w.native).to(dtype)
        return y if bias is None else y + bias
    xb = x.to(COMPUTE_DTYPE)
    if w.kind == "int4":
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, w.weight, w.group_size, w.scales)
        if w.split:
            y = y[:, : w.out_features].float() + y[:, w.out_features:].float()
    elif w.kind == "int8":
        y = torch.ops.aten._weight_int8pack_mm(xb, w.weight, w.scales)
    else:
        y = F.linear(xb, w.weight)
    y = y.to(dtype)
    return y if bias is None else y + bias
