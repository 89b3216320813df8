"""rooflm: an LLM inference and serving engine that knows its roofline."""
from __future__ import annotations

from typing import TYPE_CHECKING

from rooflm.outputs import CompletionOutput, RequestOutput
from rooflm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]

if TYPE_CHECKING:
    from rooflm.llm import LLM


def __getattr__(name: str):  # torch-heavy parts load on first use
    if name == "LLM":
        from rooflm.llm import LLM

        return LLM
    raise AttributeError(name)
