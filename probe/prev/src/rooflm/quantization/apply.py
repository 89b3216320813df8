"""Load-time quantization of a built model, and the weight bytes its matmuls read (for the roofline).

``quantize_model`` replaces the float weight of every decoder ``Linear`` (and of the LM head when
``QuantConfig.lm_head``) by a quantized one, on the device the weight lives on, one layer at a time, so the float
copy of a layer is released before the next is quantized:

- ``w8a16`` / ``w4a16``: round-to-nearest (``rooflm.quantization.rtn``): 8 bits with one scale per output channel,
  or 4 bits with a scale and zero point per group of 128 input columns. Where 128 does not divide a layer's input
  size (SmolLM2's hidden size 576), the group is the largest power of two that divides both, so every group still
  covers whole columns;
- ``fp8``: float8 e4m3 with one scale per output channel (``rooflm.quantization.fp8``).

Layers marked ``keep_float`` (a MoE router) and Mixtral's stacked experts stay float.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from rooflm.layers.embedding import LMHead
from rooflm.layers.linear import Linear, QuantizableMixin
from rooflm.quantization.config import QuantConfig
from rooflm.quantization.fp8 import check_fp8_device, quantize_fp8_weight
from rooflm.quantization.rtn import quantize_rtn


def rtn_group_size(in_features: int, group_size: int | None) -> int:
    """The group of a layer with ``in_features`` columns: ``group_size`` where it divides them, else the largest
    divisor of ``in_features`` that also divides ``group_size`` (for 128: a power of two); None: one group per
    output channel."""
    if group_size is None:
        return in_features
    return math.gcd(in_features, group_size)


@torch.no_grad()
def quantize_layer(layer: QuantizableMixin, qcfg: QuantConfig) -> None:
    """Quantize one float ``Linear`` or ``LMHead`` in place with ``qcfg.method`` ("w8a16", "w4a16" or "fp8")."""
    w = layer.weight.detach()
    if qcfg.method == "fp8":
        layer.set_fp8(quantize_fp8_weight(w))
    elif qcfg.is_rtn:
        layer.set_packed(quantize_rtn(w, qcfg.bits, rtn_group_size(layer.in_features, qcfg.group_size), w.dtype))
    else:
        raise ValueError(f"quantization={qcfg.method!r} is not applied at load time: expected 'w8a16', 'w4a16' or "
                         "'fp8'")


def quantize_model(model: nn.Module, qcfg: QuantConfig) -> list[str]:
    """Quantize every float ``Linear`` of ``model`` but those marked ``keep_float``, and the LM head when
    ``qcfg.lm_head``. Returns the names of the layers quantized. ValueError naming ``quantization`` for fp8 on a
    GPU without fp8 tensor cores."""
    first = next(model.parameters(), None)
    if qcfg.method == "fp8" and first is not None:
        check_fp8_device(first.device)
    done: list[str] = []
    for name, m in model.named_modules():
        take = (isinstance(m, Linear) and not m.keep_float) or (isinstance(m, LMHead) and qcfg.lm_head)
        if take and not m.quantized:
            quantize_layer(m, qcfg)
            done.append(name)
    return done


def projection_weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes, elements) of the decoder's projection weights as its matmuls read them: every ``Linear`` but those
    kept float (the router), packed or fp8 bytes where quantized (``PackedWeight.nbytes``: codes, scales and
    mins), plus Mixtral's stacked experts (3-D parameters). The embedding, the LM head, norms and biases are left
    out: the roofline counts them in the float format."""
    nbytes = elems = 0
    for m in model.modules():
        if isinstance(m, Linear) and not m.keep_float:
            nbytes += m.weight_nbytes
            elems += m.in_features * m.out_features
    for p in model.parameters():
        if p.dim() == 3:
            nbytes += p.numel() * p.element_size()
            elems += p.numel()
    return nbytes, elems


def weight_format(model: nn.Module):
    """The roofline's format of the projection weights of a quantized ``model`` (``rooflm.roofline.precision``):
    "4" when every packed layer has 4-bit codes, "fp8" for fp8 weights, "8" otherwise, with the bytes per element
    measured on the model (``projection_weight_bytes``, scales and mins included). None for a float model."""
    from rooflm.roofline.precision import Format, parse_bits

    layers = [m for m in model.modules() if isinstance(m, Linear) and m.quantized]
    if not layers:
        return None
    if all(m.quant == "fp8" for m in layers):
        name = "fp8"
    elif all(m.packed_weight is not None and m.packed_weight.bits == 4 for m in layers):
        name = "4"
    else:
        name = "8"
    base = parse_bits("w_bits", name)
    nbytes, elems = projection_weight_bytes(model)
    return Format(base.name, base.key, nbytes / elems, base.is_int)
