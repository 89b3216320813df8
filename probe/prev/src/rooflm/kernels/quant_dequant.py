# Weight-only quantized matmul for many rows (prefill): dequantize the whole weight once into a float buffer, then
# multiply with the vendor GEMM (cuBLAS through ``torch.nn.functional.linear``).
#
# At M rows the dequantize-in-the-loop GEMM of rooflm/kernels/quant_gemm.py converts every code once per M tile, and
# its tl.dot tiles are fed from registers rather than through the tuned pipelines of cuBLAS; measured on an H100
# (Llama-2-7B, batch x context sweep in docs/benchmarks.md) it made the prefill of a 4-bit model 0.4-0.5x as fast as
# float16, and of an 8-bit model 0.5-0.7x. For a prefill the weight's conversion is a small cost beside the product:
# one pass that reads the codes (0.5 or 1 byte a weight) and writes 2 bytes a weight, against 2 M flops a weight for
# the GEMM, so above a few hundred rows "dequantize, then GEMM" wins. This is what vLLM does for AWQ checkpoints
# above 256 tokens (awq_dequantize followed by a float matmul); decode keeps the quantized kernels, which read only
# the codes.
#
# The float weight lives in one scratch buffer per device and dtype, grown to the largest projection and reused by
# every layer (the layers run one after another on one stream). Outside CUDA-graph capture only: a prefill step is
# launched eagerly, and a buffer that grows during a capture would be freed under the graph.
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rooflm.kernels._utils import interpreting
from rooflm.quantization.packed import PackedWeight

DEQUANT_MIN_ROWS = 512  # from this many rows on, dequantize-then-GEMM (H100: the crossover lies between 256 and 512)


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, m_ptr, out_ptr, N, K, GROUP, stride_qn, stride_sn, stride_on,
                    BITS: tl.constexpr, HAS_MIN: tl.constexpr, BF16: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_n.to(tl.int64)[:, None]
    if BITS == 4:
        # Byte j holds column 2j in its low nibble and 2j + 1 in its high one, both in one group (groups are even).
        # The two float16 / bfloat16 results are packed into one 32-bit word and stored as such (out_ptr is the
        # output viewed as int32): contiguous 4-byte stores, no interleaving shuffle.
        offs_b = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        mask = (offs_n < N)[:, None] & (offs_b < K // 2)[None, :]
        b = tl.load(q_ptr + rows * stride_qn + offs_b[None, :], mask=mask, other=0).to(tl.int32)
        sp = rows * stride_sn + (2 * offs_b // GROUP)[None, :]
        s = tl.load(s_ptr + sp, mask=mask, other=0.0).to(tl.float32)
        w_lo = (b & 0xF).to(tl.float32) * s
        w_hi = (b >> 4).to(tl.float32) * s
        if HAS_MIN:
            mn = tl.load(m_ptr + sp, mask=mask, other=0.0).to(tl.float32)
            w_lo = w_lo + mn
            w_hi = w_hi + mn
        if BF16:
            lo = w_lo.to(tl.bfloat16).to(tl.int16, bitcast=True)
            hi = w_hi.to(tl.bfloat16).to(tl.int16, bitcast=True)
        else:
            lo = w_lo.to(tl.float16).to(tl.int16, bitcast=True)
            hi = w_hi.to(tl.float16).to(tl.int16, bitcast=True)
        word = (lo.to(tl.int32) & 0xFFFF) | (hi.to(tl.int32) << 16)
        tl.store(out_ptr + rows * stride_on + offs_b[None, :], word, mask=mask)
    else:
        offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
        code = tl.load(q_ptr + rows * stride_qn + offs_k[None, :], mask=mask, other=0).to(tl.int32)
        sp = rows * stride_sn + (offs_k // GROUP)[None, :]
        w = code.to(tl.float32) * tl.load(s_ptr + sp, mask=mask, other=0.0).to(tl.float32)
        if HAS_MIN:
            w = w + tl.load(m_ptr + sp, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows * stride_on + offs_k[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


_scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def dequantize_into(pw: PackedWeight, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The float weight [N, K] in stored column order (``packed.dequantize(pw, dtype, unpermute=False)``, computed
    in float32 like it), written into ``out`` or a scratch buffer shared by every call on this device and dtype (valid
    until the next call)."""
    n, k = pw.out_features, pw.in_features
    if out is None:
        key = (pw.qweight.device, dtype)
        buf = _scratch.get(key)
        if buf is None or buf.numel() < n * k:
            _scratch.pop(key, None)  # free the old one first: the peak stays one buffer
            buf = _scratch[key] = torch.empty(n * k, dtype=dtype, device=pw.qweight.device)
        out = buf[: n * k].view(n, k)
    elif tuple(out.shape) != (n, k) or out.stride(-1) != 1:
        raise ValueError(f"out has shape {tuple(out.shape)} (strides {out.stride()}), expected ({n}, {k}), contiguous")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype={dtype}: the dequantized weight is float16 or bfloat16")
    bn, bk = 16, 256
    dst = out
    if pw.bits == 4:  # two columns a 32-bit word (see the kernel)
        if out.stride(0) % 2 or out.data_ptr() % 4:
            raise ValueError(f"out (strides {out.stride()}) must hold whole 32-bit words a row for 4-bit codes")
        dst = out.view(torch.int32)
    _dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        pw.qweight, pw.scales, pw.mins if pw.mins is not None else pw.scales, dst, n, k, pw.group_size,
        pw.qweight.stride(0), pw.scales.stride(0), dst.stride(0),
        BITS=pw.bits, HAS_MIN=pw.mins is not None, BF16=dtype == torch.bfloat16, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=4)
    return out


def use_dequant_gemm(x: torch.Tensor, min_rows: int = DEQUANT_MIN_ROWS) -> bool:
    """True when ``quant_linear`` should dequantize and call the float GEMM: at least ``min_rows`` rows of a CUDA
    float16 / bfloat16 x, outside CUDA-graph capture."""
    return (x.shape[0] >= min_rows and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)
            and not interpreting() and not torch.cuda.is_current_stream_capturing())


def dequant_linear(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` through the float GEMM; x [M, K] already gathered by ``pw.perm``."""
    return torch.nn.functional.linear(x, dequantize_into(pw, x.dtype), bias)
