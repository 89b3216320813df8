"""Tiny random Llama checkpoints for the quantization tests: a config.json alone (dummy weights) and a safetensors
folder written from a rooflm model under Hugging Face names."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

# hidden 64 and intermediate 96: every projection dimension is a multiple of 16 (fp8 tensor cores) and 128 divides
# neither input size, so 4-bit RTN falls back to smaller groups (64 and 32).
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-5}


def write_config(folder: Path, **overrides) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps({**TINY_LLAMA, **overrides}))
    return path


def save_checkpoint(model: torch.nn.Module, folder: Path) -> None:
    """model's weights as one HF-named safetensors file in ``folder`` (beside its config.json)."""
    from safetensors.torch import save_file

    tensors = {name: t.view().clone().contiguous() for name, t in model.weight_targets().items()}
    save_file(tensors, str(folder / "model.safetensors"))


@pytest.fixture
def tiny_config(tmp_path) -> Path:
    """A config.json of a tiny Llama (load_model gives it random weights)."""
    return write_config(tmp_path / "tiny")


@pytest.fixture
def tiny_checkpoint(tmp_path) -> Path:
    """A float safetensors checkpoint folder of a tiny Llama with random weights (std 0.08: logits of order 1)."""
    from rooflm.loader import load_model
    from rooflm.loader.dummy import init_dummy_weights

    folder = tmp_path / "ckpt"
    write_config(folder)
    model, _ = load_model(str(folder / "config.json"), load_format="dummy", show_progress=False)
    init_dummy_weights(model, seed=5, std=0.08)
    save_checkpoint(model, folder)
    return folder


def prompt_ids(n: int = 13, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY_LLAMA["vocab_size"], (n,), generator=g).tolist()


@torch.no_grad()
def prefill_logits(model: torch.nn.Module, cfg, ids: list[int]) -> torch.Tensor:
    """Logits of every position of ``ids`` through a fresh paged cache."""
    from rooflm.attention.metadata_utils import allocate_kv_caches, single_sequence_metadata

    block = 4
    emb = model.model.embed_tokens.weight
    caches = allocate_kv_caches(cfg.num_hidden_layers, (len(ids) + block - 1) // block, block,
                                cfg.num_key_value_heads, cfg.head_dim, dtype=emb.dtype, device=emb.device)
    meta, positions = single_sequence_metadata(0, len(ids), block, emb.device)
    return model.compute_logits(model(torch.tensor(ids, device=emb.device), positions, caches, meta))


@pytest.fixture
def logits_of():
    return prefill_logits


@pytest.fixture
def ids() -> list[int]:
    return prompt_ids()


@pytest.fixture
def make_config():
    return write_config


@pytest.fixture
def save_weights():
    return save_checkpoint
