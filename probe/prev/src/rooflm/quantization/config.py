"""``quantization=``: how a model's projections are stored and multiplied (vLLM's names).

- ``"none"``: float weights (the model's dtype);
- ``"w8a16"``: int8 weights, one scale per output channel, round-to-nearest at load time; 16-bit activations;
- ``"w4a16"``: int4 weights with a scale and a zero point per group of 128 input columns, round-to-nearest at load;
- ``"gptq"`` / ``"awq"``: the int4 (or int8) weights of a GPTQ (Frantar et al. 2023) or AWQ (Lin et al. 2024)
  checkpoint, detected from its ``config.json``;
- ``"gguf"``: a GGUF file's quantized blocks kept quantized (the default for ``.gguf`` files); ``"none"``
  dequantizes them at load time instead;
- ``"fp8"``: W8A8 in float8 e4m3 (Micikevicius et al. 2022): weights with a per-output-channel scale, activations
  quantized per token at run time; ``torch._scaled_mm`` on GPUs with fp8 tensor cores (compute capability >= 8.9).

The decoder's ``Linear`` layers are quantized; the embedding, the norms and (unless ``lm_head``) the LM head stay
float, as AWQ, GPTQ and vLLM's fp8 do. Mixtral's stacked expert weights stay float as well.
"""
from __future__ import annotations

from dataclasses import dataclass

QUANTIZATION_METHODS = ("none", "w8a16", "w4a16", "gptq", "awq", "gguf", "fp8")
RTN_METHODS = ("w8a16", "w4a16")  # round-to-nearest applied to float weights at load time
CHECKPOINT_METHODS = ("gptq", "awq")  # read from a quantized checkpoint's config.json

_DEFAULT_BITS = {"none": 16, "w8a16": 8, "w4a16": 4, "gptq": 4, "awq": 4, "gguf": 4, "fp8": 8}
_DEFAULT_GROUP = {"w4a16": 128}


def check_quantization(value: object, field: str = "quantization") -> str | None:
    """``value`` if it is None or one of ``QUANTIZATION_METHODS``; otherwise ValueError naming ``field``."""
    if value is not None and value not in QUANTIZATION_METHODS:
        raise ValueError(f"{field}={value!r} is invalid: expected None or one of {', '.join(QUANTIZATION_METHODS)}")
    return value


@dataclass
class QuantConfig:
    """One quantization setting. ``bits`` and ``group_size`` default from ``method`` (RTN: 8 bits per output
    channel, 4 bits in groups of 128; a checkpoint's own values replace them when it is read); ``group_size`` None
    means one group per output channel. ``lm_head``: quantize the LM head too (off by default: it is one matrix
    and the logits are the most sensitive output)."""

    method: str = "none"
    bits: int | None = None
    group_size: int | None = None
    lm_head: bool = False

    def __post_init__(self) -> None:
        check_quantization(self.method, "quantization")
        if self.method is None:
            raise ValueError(f"quantization=None is invalid here: expected one of {', '.join(QUANTIZATION_METHODS)}")
        if self.bits is None:
            self.bits = _DEFAULT_BITS[self.method]
        if self.group_size is None:
            self.group_size = _DEFAULT_GROUP.get(self.method)
        if self.method in RTN_METHODS and self.bits != _DEFAULT_BITS[self.method]:
            raise ValueError(f"QuantConfig.bits={self.bits} is invalid for quantization={self.method!r}: expected "
                             f"{_DEFAULT_BITS[self.method]}")
        if self.group_size is not None and (not isinstance(self.group_size, int) or self.group_size < 1):
            raise ValueError(f"QuantConfig.group_size={self.group_size!r} is invalid: expected a positive integer "
                             "or None (one group per output channel)")
        if not isinstance(self.lm_head, bool):
            raise ValueError(f"QuantConfig.lm_head={self.lm_head!r} is invalid: expected True or False")

    @property
    def is_rtn(self) -> bool:
        return self.method in RTN_METHODS

    @classmethod
    def parse(cls, value: "str | QuantConfig | None") -> "QuantConfig | None":
        """A method name, a ``QuantConfig`` or None (decided by the checkpoint) -> ``QuantConfig`` or None."""
        if value is None or isinstance(value, QuantConfig):
            return value
        return cls(method=check_quantization(value))
