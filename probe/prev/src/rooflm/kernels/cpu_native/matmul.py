"""The native kernel's weight layout and its matmul (see ``qmm.c`` for the maths and the layout).

``pack_native`` repacks a ``PackedWeight`` once, at load time; ``native_linear`` multiplies float activations with
it. A weight the kernel cannot take (group sizes that are not multiples of 32, such as GGUF Q6_K's 16) is left to
torch's kernels by ``native_supports``.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from rooflm.quantization.packed import PackedWeight, codes

BLOCK = 32
GROUP_ROWS = 16  # output rows interleaved in the kernel's layout


class _Weight(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("mins", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("nb", ctypes.c_int64), ("bits", ctypes.c_int64),
                ("f16", ctypes.c_int64)]


@dataclass(eq=False)
class NativeWeight:
    """A weight in the native kernel's layout (``qmm.c`` describes it): output rows in groups of 16, ``codes`` uint8
    [groups, nb, 256] (4 bits) or [groups, nb, 512] (8 bits, the stored code is q + 128) with the 16 rows interleaved
    four columns at a time, ``scales`` / ``mins`` [groups, nb, 16], nb the number of 32-column blocks; W = q * scale
    + min per block. Scales and mins are float16 when that holds them exactly (GGUF's block scales are float16: 20
    bytes a block of Q4_1, as in the file), else float32."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bits: int
    out_features: int
    in_features: int
    lib: ctypes.CDLL
    _struct: _Weight = field(init=False, repr=False)
    _ref: object = field(init=False, repr=False)

    def __post_init__(self) -> None:
        nb = self.scales.shape[1]
        self._struct = _Weight(self.codes.data_ptr(), self.scales.data_ptr(),
                               self.mins.data_ptr() if self.mins is not None else None, self.out_features,
                               self.in_features, nb, self.bits, int(self.scales.dtype == torch.float16))
        self._ref = ctypes.byref(self._struct)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins) if t is not None)


def native_supports(pw: PackedWeight) -> bool:
    """True when ``pack_native`` can take ``pw``: 4- or 8-bit codes in groups that are whole 32-column blocks."""
    k = pw.in_features
    return pw.bits in (4, 8) and k % BLOCK == 0 and pw.group_size % BLOCK == 0 and pw.qweight.device.type == "cpu"


def _blocks(t: torch.Tensor, group_size: int, ng: int) -> torch.Tensor:
    """Per-group values [N, K / g] -> float32 per 32-column block, rows grouped: [ng, nb, 16] (padding rows 0)."""
    t = t.float().repeat_interleave(group_size // BLOCK, dim=1)
    t = torch.nn.functional.pad(t, (0, 0, 0, ng * GROUP_ROWS - t.shape[0]))
    return t.view(ng, GROUP_ROWS, -1).transpose(1, 2).contiguous()


def _exact_half(t: torch.Tensor | None) -> bool:
    return t is None or torch.equal(t.half().float(), t)


def pack_native(pw: PackedWeight, lib: ctypes.CDLL, half: bool | None = None) -> NativeWeight:
    """Repack ``pw`` (column order as stored: a ``perm`` is applied to the input by the caller). ``half``: store
    scales and mins as float16 (None: when that is exact; True where it is not raises ValueError)."""
    if not native_supports(pw):
        raise ValueError(f"the native kernel takes 4- or 8-bit codes with groups of a multiple of 32 columns and "
                         f"in_features a multiple of 32 on the CPU, got bits={pw.bits}, group_size={pw.group_size}, "
                         f"in_features={pw.in_features}, device={pw.qweight.device}")
    n, k = pw.out_features, pw.in_features
    nb, ng = k // BLOCK, -(-n // GROUP_ROWS)
    q = codes(pw)  # int16 [N, K]
    q = torch.nn.functional.pad(q, (0, 0, 0, ng * GROUP_ROWS - n), value=0 if pw.bits == 4 else -128)
    if pw.bits == 4:  # [g, r, b, octet, half, j] -> [g, b, octet, r, j], low nibble half 0, high nibble half 1
        q = q.to(torch.uint8).view(ng, GROUP_ROWS, nb, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
        packed = q[..., 0] | (q[..., 1] << 4)
    else:  # [g, r, b, quad, j] -> [g, b, quad, r, j]
        packed = (q + 128).to(torch.uint8).view(ng, GROUP_ROWS, nb, 8, 4).permute(0, 2, 3, 1, 4)
    packed = packed.reshape(ng, nb, -1)
    scales = _blocks(pw.scales, pw.group_size, ng)
    mins = _blocks(pw.mins, pw.group_size, ng) if pw.mins is not None else None
    exact = _exact_half(scales) and _exact_half(mins)
    if half and not exact:
        raise ValueError("half=True: the scales or mins of this weight are not exact in float16")
    if exact if half is None else half:
        scales, mins = scales.half(), None if mins is None else mins.half()
    return NativeWeight(packed.contiguous(), scales, mins, pw.bits, n, k, lib)


def native_linear(x: torch.Tensor, w: NativeWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` for x float32 [M, K] (other float dtypes are converted); float32 [M, N]. The activations are
    quantized to int8 per block of 32 inside the kernel."""
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected [M, {w.in_features}]")
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    m = x.shape[0]
    if out is None:
        out = torch.empty(m, w.out_features, dtype=torch.float32)
    rc = w.lib.qmm_matmul(w._ref, x.data_ptr(), out.data_ptr(), m, torch.get_num_threads())
    if rc:
        raise MemoryError(f"native quantized matmul failed (code {rc}) for M={m}, N={w.out_features}, "
                          f"K={w.in_features}")
    return out


def quantize_activations_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel does to x [M, K] (K a multiple of 32): int8-valued codes [M, K] and per-block scales
    [M, K / 32], with d = max|x| / 127 and q = round-half-even(x * 127 / max|x|)."""
    m, k = x.shape
    xb = x.float().view(m, k // BLOCK, BLOCK)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv)
    return q.view(m, k), (amax / 127.0).view(m, k // BLOCK)
