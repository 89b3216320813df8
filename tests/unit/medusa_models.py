"""A tiny Llama whose greedy continuations are known, for the Medusa self-distillation tests (CPU and GPU)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
        "vocab_size": 16, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


def cycling_model(folder: Path, dtype: torch.dtype, device: str):
    """Random weights, but greedy continuations cycle through tokens 3..15 (u -> 3 + (u - 3 + 5) mod 13): the LM head
    row of token perm(u) is 10 x u's embedding, so the argmax after u is perm(u). Random weights alone continue every
    prompt with one repeated token, which untrained heads (copies of the LM head) already predict. Frozen."""
    from rooflm.loader import load_model

    path = Path(folder) / "config.json"
    path.write_text(json.dumps(dict(TINY, tie_word_embeddings=False)))
    model, cfg = load_model(str(path), load_format="dummy", dtype=dtype, device=device, show_progress=False, seed=3)
    perm = torch.tensor([0, 1, 2] + [3 + (u - 3 + 5) % 13 for u in range(3, 16)], device=device)
    with torch.no_grad():
        weight = torch.empty_like(model.lm_head.weight)
        weight[perm] = 10 * model.model.embed_tokens.weight
        model.lm_head.weight.copy_(weight)
    for p in model.parameters():
        p.requires_grad_(False)
    return model, cfg


def random_text(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 16, (n,), generator=g).tolist()
