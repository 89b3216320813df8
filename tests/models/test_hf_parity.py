"""Logits of rooflm models equal transformers' (the oracle) on tiny random checkpoints, loaded through the
safetensors path: every architecture, GQA / MQA / MHA, tied embeddings, QKV bias, llama3 rope scaling, a sliding
window shorter than the prompt, sharded checkpoints, and decode steps through the paged cache."""
from __future__ import annotations

import pytest
import torch
import transformers

from model_utils import PagedRunner, assert_close_rel
from rooflm.loader import load_model

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            head_dim=16, max_position_embeddings=256, initializer_range=0.08)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 500000.0}

CASES = {
    # name: (transformers config class, model class, overrides)
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2)),
    "llama-mqa": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=1)),
    "llama-mha-tied": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True)),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, rope_parameters=LLAMA3_ROPE)),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=5)),
    "qwen2-bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "mixtral-moe": ("MixtralConfig", "MixtralForCausalLM",
                    dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
}
PROMPT_LEN = 23  # > 5 blocks of 4 and > the sliding window


def make_checkpoint(case: str, folder, seed: int = 0, **save_kwargs) -> torch.nn.Module:
    cfg_cls, model_cls, overrides = CASES[case]
    config = getattr(transformers, cfg_cls)(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # HF initialises biases to zero: make them matter
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.5)
    model.save_pretrained(folder, **save_kwargs)
    return model


def prompt(n: int = PROMPT_LEN, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_logits_match_transformers(case: str, tmp_path) -> None:
    hf = make_checkpoint(case, tmp_path)
    model, cfg = load_model(str(tmp_path), show_progress=False)
    assert type(model).__name__ == CASES[case][1]
    if case == "mistral-window":
        assert cfg.sliding_window == 5
    ids = prompt()
    ours = PagedRunner(model, cfg, max_tokens=len(ids)).step(ids)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    assert_close_rel(ours, theirs)


@pytest.mark.parametrize("case", ["llama-gqa", "mistral-window", "qwen2-bias"])
def test_prefill_then_decode_matches_full_sequence(case: str, tmp_path) -> None:
    """Prefill 9 tokens (a partial block), then 1-token decode steps, then a 3-token chunk, all through the cache."""
    hf = make_checkpoint(case, tmp_path)
    model, cfg = load_model(str(tmp_path), show_progress=False)
    ids = prompt(17)
    runner = PagedRunner(model, cfg, max_tokens=len(ids))
    chunks = [ids[:9]] + [[t] for t in ids[9:14]] + [ids[14:]]
    ours = torch.cat([runner.step(c) for c in chunks])
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    assert_close_rel(ours, theirs)


def test_sharded_checkpoint(tmp_path) -> None:
    hf = make_checkpoint("llama-gqa", tmp_path, max_shard_size="40KB")
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    model, cfg = load_model(str(tmp_path), show_progress=False)
    ids = prompt()
    with torch.no_grad():
        assert_close_rel(PagedRunner(model, cfg, len(ids)).step(ids), hf(torch.tensor([ids])).logits[0])


def test_bfloat16_load_runs(tmp_path) -> None:
    """A reduced-precision load keeps its dtype end to end and stays near the float32 oracle."""
    hf = make_checkpoint("llama-gqa", tmp_path)
    model, cfg = load_model(str(tmp_path), dtype=torch.bfloat16, show_progress=False)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ids = prompt()
    ours = PagedRunner(model, cfg, len(ids)).step(ids)
    assert ours.dtype == torch.float32
    with torch.no_grad():
        assert_close_rel(ours, hf(torch.tensor([ids])).logits[0], rel=5e-2)
