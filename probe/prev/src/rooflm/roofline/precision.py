"""Bit widths of weights, activations and the KV cache, and which compute peak a matmul gets.

A bit width is given as a string (or int): ``32``, ``16``, ``bf16``, ``8`` (int8), ``fp8`` or ``4`` (int4).
Rules (Yuan et al. 2024, Sec. 3.1.1): a matmul runs at a low-precision peak (int8, fp8) only when *both* operands are in that
format; otherwise the low-precision operand is converted ("dequantized") to the wider float format, and the
conversion is reported as its own figure (``dequant_ops``) while the matmul's OPs stay 2·in·out·tokens."""
from __future__ import annotations

from dataclasses import dataclass

# name -> (peak key in Hardware.peak_flops, bytes per element, is integer)
_FORMATS: dict[str, tuple[str, float, bool]] = {
    "32": ("fp32", 4.0, False),
    "16": ("fp16", 2.0, False),
    "bf16": ("bf16", 2.0, False),
    "8": ("int8", 1.0, True),
    "fp8": ("fp8", 1.0, False),
    "4": ("int4", 0.5, True),
}
ACCEPTED_BITS = tuple(_FORMATS)
# Converting one low-precision element to the compute format: one scale multiply and one zero-point subtract.
DEQUANT_OPS_PER_ELEMENT = 2


@dataclass(frozen=True)
class Format:
    """One number format: ``name`` as the user wrote it, ``key`` the peak it computes at, ``bytes`` per element."""

    name: str
    key: str
    bytes: float
    is_int: bool


def parse_bits(field: str, value: object) -> Format:
    """Parse a bit width; a bad value raises ``ValueError`` naming ``field`` and listing the accepted values."""
    text = str(value).strip().lower()
    if text not in _FORMATS:
        raise ValueError(f"{field}={value!r} is invalid: expected one of {', '.join(ACCEPTED_BITS)}")
    key, nbytes, is_int = _FORMATS[text]
    return Format(text, key, nbytes, is_int)


@dataclass(frozen=True)
class Precision:
    """The three bit widths of a deployment. ``high`` is the float format kept for what is never quantized here:
    embeddings, lm_head, norms, router and biases (as AWQ/GPTQ/bitsandbytes and vLLM's fp8 do)."""

    weight: Format
    act: Format
    kv: Format

    @classmethod
    def of(cls, w_bits: object = 16, a_bits: object = 16, kv_bits: object = 16) -> "Precision":
        return cls(parse_bits("w_bits", w_bits), parse_bits("a_bits", a_bits), parse_bits("kv_bits", kv_bits))

    @property
    def high(self) -> Format:
        """Float format of un-quantized tensors: fp32 if activations are fp32, else the 16-bit format."""
        if self.act.key in ("fp32", "fp16", "bf16"):
            return self.act
        return parse_bits("a_bits", "16")

    @property
    def label(self) -> str:
        return f"W{self.weight.name}A{self.act.name}KV{self.kv.name}"


def compute_key(x: Format, y: Format, available: dict[str, float]) -> str:
    """Peak key a product of operands ``x`` and ``y`` runs at on a device with ``available`` peaks.

    - same format and the device has its peak: that peak (int8·int8 -> int8, fp8·fp8 -> fp8);
    - both integer (int4·int8, or int4 without int4 units): int8, if available;
    - otherwise the operands are converted to the wider float format: fp32 if either is fp32, else 16-bit.
    Falls back along fp16 -> bf16 -> fp32 when the device lacks a 16-bit peak (CPUs)."""
    if x.key == y.key and x.key in available:
        return x.key
    if x.is_int and y.is_int and "int8" in available:
        return "int8"
    if "fp32" in (x.key, y.key):
        return "fp32"
    preferred = "bf16" if "bf16" in (x.key, y.key) else "fp16"
    for key in (preferred, "fp16", "bf16", "fp32"):
        if key in available:
            return key
    raise ValueError(f"hardware has no peak for {x.key}·{y.key}: has {sorted(available)}")


def elementwise_key(act: Format, available: dict[str, float]) -> str:
    """Peak of element-wise operators (norms, softmax, activations, adds). LLM-Viewer (Yuan et al. 2024) uses one
    peak for every operator (Table 1: 155T on an A6000 for softmax too); element-wise operators are memory-bound on every device listed, so
    the choice does not change their time."""
    return compute_key(act, act, available) if act.key in ("fp32", "fp16", "bf16") else compute_key(
        parse_bits("a_bits", "16"), parse_bits("a_bits", "16"), available)
