"""Helpers for the model tests: tiny transformers models as oracles, and driving a rooflm model over a paged cache."""
from __future__ import annotations

import json

import torch

from rooflm.attention.metadata_utils import allocate_kv_caches, single_sequence_metadata
from rooflm.config import ModelConfig
from rooflm.loader import load_model

# a two-layer Llama whose sizes the native CPU kernel takes (multiples of 32), with grouped-query attention
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5}


def load_tiny(tmp_path_factory, quantization: str, **overrides):
    """``TINY`` (with ``overrides``) with random weights, quantized as asked at load: (model, config)."""
    folder = tmp_path_factory.mktemp("tiny")
    (folder / "config.json").write_text(json.dumps({**TINY, **overrides}))
    return load_model(str(folder / "config.json"), load_format="dummy", show_progress=False,
                      quantization=quantization)


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-4) -> None:
    """|actual - expected| <= rel * max|expected| everywhere (relative to the logits' scale)."""
    scale = expected.abs().max().item()
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= rel * scale, f"max abs error {err:.3g} exceeds {rel} x max|expected| = {rel * scale:.3g}"


class PagedRunner:
    """Runs one sequence through a rooflm model step by step over a paged KV cache (blocks 0, 1, 2, ...)."""

    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, max_tokens: int, block_size: int = 4) -> None:
        self.model, self.block_size = model, block_size
        num_blocks = (max_tokens + block_size - 1) // block_size
        dtype = next(model.parameters()).dtype
        self.kv_caches = allocate_kv_caches(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads,
                                            cfg.head_dim, dtype=dtype)
        self.num_computed = 0

    @torch.no_grad()
    def step(self, token_ids: list[int]) -> torch.Tensor:
        """Compute ``token_ids`` after the cached ones; returns their logits [len(token_ids), vocab] float32."""
        meta, positions = single_sequence_metadata(self.num_computed, len(token_ids), self.block_size)
        hidden = self.model(torch.tensor(token_ids), positions, self.kv_caches, meta)
        self.num_computed += len(token_ids)
        return self.model.compute_logits(hidden)


def hf_model_from_gguf(path: str) -> torch.nn.Module:
    """transformers' own GGUF path (config parsing, dequantization, q/k un-permutation) without needing accelerate:
    what ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` does, float32."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.for_model(**load_gguf_checkpoint(path)["config"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing, _ = model.load_state_dict(tensors, strict=False)
    assert set(missing) <= {"lm_head.weight"}, missing  # tied to the embedding
    model.tie_weights()
    return model.eval()
