"""Weight projections. Every ``Linear`` (and the LM head, and the MoE experts) multiplies through one of two functions:

- ``linear_native``: ``F.linear``, the reference;
- ``linear_triton``: at <= 16 rows (decode, a few tokens) a GEMV / flat-GEMM Triton kernel, picked per shape by timing
  it against ``F.linear`` (FlashDecoding++'s heuristic, ``rooflm/kernels/gemv.py``); ``F.linear`` above.

Which of the two a layer uses is chosen once, at construction (``rooflm.layers.custom_op``); only the row-count test
inside ``linear_triton`` runs per call, since it depends on the batch.

A ``Linear`` (and the ``LMHead``) may instead hold a quantized weight (``rooflm.quantization``): ``set_packed`` stores
a weight-only int4/int8 ``PackedWeight`` and ``set_fp8`` an fp8 W8A8 weight, each as buffers in place of the float
Parameter (which is released). The matmul is then chosen once, when the weight is set or the module moves:

- packed, reference path: ``quant_linear_native`` (dequantize, then ``F.linear``);
- packed, CPU path: ``rooflm.kernels.cpu_quant`` (torch's packed int4 / int8 CPU kernels; the weight is converted to
  their layout once, when the implementation is chosen);
- packed, Triton path: ``rooflm.kernels.quant_gemm.quant_linear``;
- fp8: ``torch._scaled_mm`` on the Triton path of a GPU with fp8 tensor cores, its float32 twin otherwise
  (``rooflm.quantization.fp8``).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from rooflm.kernels.cpu_quant import prepare_cpu, quant_linear_cpu  # plain torch: no triton import
from rooflm.layers.custom_op import CPU, TRITON, CustomOp
from rooflm.quantization.fp8 import (Fp8Weight, check_fp8_device, fp8_linear_reference, fp8_linear_scaled_mm,
                                     fp8_supported, scaled_mm_shape_ok)
from rooflm.quantization.packed import PackedWeight, quant_linear_reference

GEMV_MAX_ROWS = 16  # at most this many rows go to the GEMV kernels; a GEMM wins above


def fused_gemv_allowed_by_env() -> bool:
    """``ROOFLM_FUSED_GEMV=off`` keeps the fused projections of the Triton path (``RMSNormLinear``,
    ``SiluAndMulLinear``) on their unfused pairs. Read when an op chooses its implementation; the other values
    ("auto", "on") are read by ``rooflm.kernels.fused_gemv``."""
    return os.environ.get("ROOFLM_FUSED_GEMV", "auto") != "off"


def linear_native(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``. x: [num_tokens, in_features]; weight: [out_features, in_features] (HF layout);
    bias: [out_features] or None. Returns [num_tokens, out_features] in x's dtype."""
    return F.linear(x, weight, bias)


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as ``linear_native``; small batches go to the GEMV kernels."""
    if x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS:
        from rooflm.kernels.gemv import linear as gemv_linear

        return gemv_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def quant_linear_native(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for a packed W on the reference path: what every quantized ``Linear`` and ``LMHead`` of
    the reference path calls (the one place to point at a faster CPU kernel with the same contract)."""
    return quant_linear_reference(x, pw, bias)


def _packed_native(layer: "QuantizableMixin", x: torch.Tensor) -> torch.Tensor:
    return quant_linear_native(x, layer.packed_weight, layer.bias)


def _packed_cpu(layer: "QuantizableMixin", x: torch.Tensor) -> torch.Tensor:
    return quant_linear_cpu(x, layer._cpu_weight, layer.bias)


def _packed_cuda(layer: "QuantizableMixin", x: torch.Tensor) -> torch.Tensor:
    from rooflm.kernels.quant_gemm import quant_linear

    return quant_linear(x, layer.packed_weight, layer.bias)


def _fp8_twin(layer: "QuantizableMixin", x: torch.Tensor) -> torch.Tensor:
    return fp8_linear_reference(x, layer.fp8_weight, layer.bias)


def _fp8_scaled_mm(layer: "QuantizableMixin", x: torch.Tensor) -> torch.Tensor:
    return fp8_linear_scaled_mm(x, layer.fp8_weight, layer.bias)


class QuantizableMixin:
    """The quantized-weight half of ``Linear`` and ``LMHead`` (mixed into a ``CustomOp`` with ``weight``, ``bias``,
    ``in_features`` and ``out_features``). ``quant`` is None (float), ``"packed"`` or ``"fp8"``."""

    quant: str | None = None
    bias: torch.Tensor | None
    in_features: int
    out_features: int
    _packed: PackedWeight | None = None
    _fp8: Fp8Weight | None = None
    _cpu_weight = None  # the packed weight in torch's CPU kernel layout (rooflm.kernels.cpu_quant), on the CPU path

    @property
    def quantized(self) -> bool:
        """True once the float weight was replaced by a packed or fp8 one."""
        return self.quant is not None

    @property
    def packed_weight(self) -> PackedWeight | None:
        return self._packed

    @property
    def fp8_weight(self) -> Fp8Weight | None:
        return self._fp8

    @property
    def fp8_tensor_cores(self) -> bool:
        """True when the matmul runs on fp8 tensor cores (``torch._scaled_mm``): the fused norm / activation ops
        may then hand it activations they quantized themselves."""
        return self.quant == "fp8" and getattr(self, "_impl_fn", None) is _fp8_scaled_mm

    @property
    def weight_nbytes(self) -> int:
        """Bytes of the weight one matmul reads (codes, scales and mins when quantized; the bias excluded)."""
        if self._packed is not None:
            return self._packed.nbytes
        if self._fp8 is not None:
            return self._fp8.nbytes
        return self.weight.numel() * self.weight.element_size()

    def _placement(self) -> tuple[torch.device, torch.dtype]:
        """Device and compute dtype of the current weight (float, packed or fp8)."""
        if self._packed is not None:
            return self._packed.qweight.device, self._packed.dtype
        if self._fp8 is not None:
            return self._fp8.weight.device, self._fp8_dtype
        return self.weight.device, self.weight.dtype

    def _check_shape(self, out_features: int, in_features: int, what: str) -> None:
        if (out_features, in_features) != (self.out_features, self.in_features):
            raise ValueError(f"{what} has shape ({out_features}, {in_features}), expected "
                             f"({self.out_features}, {self.in_features})")

    def _drop_quant_buffers(self) -> None:
        for name in ("qweight", "scales", "mins", "perm", "weight_fp8", "weight_scale"):
            if name in self._buffers:
                del self._buffers[name]
        self._packed = self._fp8 = None

    def set_packed(self, pw: PackedWeight) -> None:
        """Replace the weight by ``pw`` (moved to the layer's device, scales cast to its dtype). The float Parameter
        is released; the packed tensors become buffers, so ``.to()`` and ``state_dict()`` carry them."""
        self._check_shape(pw.out_features, pw.in_features, "packed weight")
        device, dtype = self._placement()
        pw = pw.to(device=device, dtype=dtype)
        self._drop_quant_buffers()
        self.weight = None  # a tied LM head lets go of its reference only: the embedding keeps its Parameter
        self.register_buffer("qweight", pw.qweight)
        self.register_buffer("scales", pw.scales)
        self.register_buffer("mins", pw.mins)
        self.register_buffer("perm", pw.perm)
        self._packed_meta = (pw.bits, pw.group_size)
        self.quant = "packed"
        self._rebuild()

    def set_fp8(self, fw: Fp8Weight) -> None:
        """Replace the weight by an fp8 one (moved to the layer's device; the compute dtype stays the layer's).
        ValueError naming ``quantization`` on a GPU without fp8 tensor cores."""
        self._check_shape(fw.out_features, fw.in_features, "fp8 weight")
        device, dtype = self._placement()
        check_fp8_device(device)
        self._drop_quant_buffers()
        self.weight = None
        self.register_buffer("weight_fp8", fw.weight.to(device))
        self.register_buffer("weight_scale", fw.scale.to(device))
        self._fp8_dtype = dtype
        self.quant = "fp8"
        self._rebuild()

    def _rebuild(self) -> None:
        """Re-make the weight view from the buffers and re-choose the matmul (after a set or a move)."""
        if self.quant == "packed":
            bits, group = self._packed_meta
            self._packed = PackedWeight(self.qweight, self.scales, self.mins, bits, group, self.perm)
        elif self.quant == "fp8":
            self._fp8 = Fp8Weight(self.weight_fp8, self.weight_scale)
        self._set_impl(self.impl)

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        if self.quant != "fp8":  # packed codes are integers: a dtype cast reaches only the scales and mins
            out = super()._apply(fn, recurse)  # type: ignore[misc]
            if self.quant is not None:
                self._rebuild()
            return out
        # fp8 codes and their float32 scales count as floating point, yet a cast (``.half()``) must not touch them:
        # they only follow the move, and the compute dtype follows the cast (read off an empty probe tensor).
        probe = fn(torch.empty(0, dtype=self._fp8_dtype, device=self.weight_fp8.device))
        kept = {name: self._buffers.pop(name) for name in ("weight_fp8", "weight_scale")}
        out = super()._apply(fn, recurse)  # type: ignore[misc]
        for name, t in kept.items():
            self._buffers[name] = t.to(probe.device)
        self._fp8_dtype = probe.dtype
        self._rebuild()
        return out

    def _quant_impl(self, impl: str):
        """The function ``forward`` runs for a quantized weight on implementation ``impl``."""
        if self.quant == "packed":
            if impl == TRITON:
                from rooflm.kernels.quant_gemv_mma import with_mma

                self._packed = with_mma(self._packed)  # the tensor-core GEMV's copy of the codes, where it may run
                return _packed_cuda
            if impl == CPU and self._packed.qweight.device.type == "cpu":
                self._cpu_weight = prepare_cpu(self._packed)  # torch's CPU kernel layout, made once
                return _packed_cpu
            return _packed_native
        fast = (impl == TRITON and fp8_supported(self._fp8.weight.device) and scaled_mm_shape_ok(self._fp8))
        return _fp8_scaled_mm if fast else _fp8_twin


class Linear(QuantizableMixin, CustomOp):
    """A weight (and optional bias) in HF layout. Parameters are allocated uninitialised (``torch.empty``): a loader
    or the dummy initialiser fills them, so building a 70B-shaped model on the target device costs no
    initialisation time.

    ``keep_float``: load-time quantization (``rooflm.quantization.apply``) leaves this layer float (a MoE router)."""

    keep_float: bool = False

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def _set_impl(self, impl: str) -> None:
        super()._set_impl(impl)
        if self.quant is not None:
            self._impl_fn = self._quant_impl(impl)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return linear_native(x, self.weight, self.bias)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        return linear_triton(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        quant = "" if self.quant is None else f", quant={self.quant}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"impl={self.impl}{quant}")
