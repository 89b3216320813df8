"""Shared helpers of the roofline tests: tiny model configs whose numbers are easy to compute by hand, and a check
that a value rounds to a figure printed with few significant digits (Table 1 of Yuan et al. 2024, LLM-Viewer)."""
from __future__ import annotations

import math
import re

from rooflm.config import ModelConfig
from rooflm.roofline import Hardware

_SCALE = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}


def tiny(**kw) -> ModelConfig:
    """h=64, I=128, H=4 query heads, Hk=2 KV heads (GQA 2:1), d=16, 2 layers, vocab 100, untied."""
    d = dict(architecture="LlamaForCausalLM", model_type="llama", vocab_size=100, hidden_size=64,
             intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             name="tiny")
    d.update(kw)
    return ModelConfig(**d)


def tiny_moe(**kw) -> ModelConfig:
    """``tiny`` with 4 experts, 2 per token (Mixtral-style)."""
    return tiny(num_local_experts=4, num_experts_per_tok=2, name="tiny-moe", **kw)


def round_hw(bw_gbs: float = 100.0, tflops: float = 10.0, ic_gbs: float | None = 50.0) -> Hardware:
    """Round numbers: 100 GB/s, 10 TFLOP/s fp16, 50 GB/s interconnect, 1 GiB."""
    return Hardware.from_measured(bw_gbs, {"fp16": tflops}, memory_gib=1.0, interconnect_gbs=ic_gbs, name="round")


def printed_matches(value: float, printed: str) -> bool:
    """True when ``value`` rounded to the significant digits of ``printed`` (e.g. "69G", "0.99", "1215", "8M")
    equals it. Table 1 prints 1 to 4 significant digits; this is its exact rounding tolerance."""
    m = re.fullmatch(r"([0-9.]+)([KMGT]?)", printed)
    assert m, printed
    mant, suffix = m.group(1), m.group(2)
    digits = len(mant.replace(".", "").lstrip("0"))
    x = value / _SCALE[suffix]
    rounded = round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))
    return math.isclose(rounded, float(mant), rel_tol=1e-9)
