"""Map a config's ``architectures`` entry (or its ``model_type``) to the model class that runs it."""
from __future__ import annotations

from torch import nn

from rooflm.config import ModelConfig
from rooflm.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from rooflm.models.mixtral import MixtralForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}
MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def get_model_class(cfg: ModelConfig) -> type[nn.Module]:
    """The class for ``cfg.architecture``, else for ``cfg.model_type``; ValueError listing the supported ones."""
    if cfg.architecture in MODEL_REGISTRY:
        return MODEL_REGISTRY[cfg.architecture]
    if cfg.model_type in MODEL_TYPES:
        return MODEL_REGISTRY[MODEL_TYPES[cfg.model_type]]
    raise ValueError(
        f"architecture={cfg.architecture!r} (model_type={cfg.model_type!r}) is not supported: rooflm runs "
        f"{', '.join(supported_architectures())} (model_type {', '.join(sorted(MODEL_TYPES))})"
    )
