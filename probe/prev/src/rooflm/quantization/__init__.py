"""Weight-only quantization: one packed layout (``packed``), the sources that produce it (round-to-nearest,
GPTQ/AWQ checkpoints, GGUF blocks) and the layer that multiplies with it."""
from rooflm.quantization.config import QUANTIZATION_METHODS, QuantConfig
from rooflm.quantization.packed import PackedWeight, cat_rows, dequantize, pack_int4, unpack_int4
from rooflm.quantization.rtn import quantize_rtn

__all__ = ["QUANTIZATION_METHODS", "QuantConfig", "PackedWeight", "cat_rows", "dequantize", "pack_int4",
           "unpack_int4", "quantize_rtn"]
