"""Medusa self-distillation on the GPU: generation, hidden states and training all run on CUDA (bfloat16 model), the
heads come back on the CPU, and `rooflm train-medusa --device cuda --self-distill` writes heads that load on the CPU.
Skipped without CUDA."""
from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "vocab_size": 16, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


def _text(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 16, (n,), generator=g).tolist()


def test_self_distillation_trains_on_cuda_and_returns_cpu_heads(tmp_path):
    from rooflm.loader import load_model
    from rooflm.spec_decode.medusa import (
        load_medusa_heads,
        model_identity,
        save_medusa_heads,
    )
    from rooflm.spec_decode.medusa_train import MedusaTrainConfig, train_medusa

    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    model, cfg = load_model(str(path), load_format="dummy", dtype=torch.bfloat16, device="cuda", show_progress=False,
                            seed=3)
    # greedy continuations cycle through tokens 3..15 (see tests/unit/test_medusa_distill.py)
    perm = torch.tensor([0, 1, 2] + [3 + (u - 3 + 5) % 13 for u in range(3, 16)], device="cuda")
    with torch.no_grad():
        weight = torch.empty_like(model.lm_head.weight)
        weight[perm] = 10 * model.model.embed_tokens.weight
        model.lm_head.weight.copy_(weight)
    for p in model.parameters():
        p.requires_grad_(False)
    tc = MedusaTrainConfig(num_heads=2, steps=60, lr=3e-2, batch_size=4, seq_len=32, eval_tokens=64,
                           warmup_steps=2, log_every=60, self_distill=24, distill_len=40, distill_prompt_len=8,
                           distill_eval=6)
    heads, s = train_medusa(model, cfg, _text(800, 1), _text(300, 2), tc, log=lambda line: None)
    before, after = s["greedy_accuracy_before"], s["greedy_accuracy_after"]
    assert after[0] > 0.95  # the labels are the model's own argmax (bfloat16 decode against prefill: near ties)
    assert after[1] > before[1] + 0.15 and after[2] > before[2] + 0.15
    assert heads.weight.device.type == "cpu" and heads.weight.dtype == torch.float32
    save_medusa_heads(heads, tmp_path / "h", model_identity(cfg, "tiny"))
    loaded, _ = load_medusa_heads(tmp_path / "h", cfg, device="cpu")
    assert torch.equal(loaded.weight, heads.weight)


def test_train_medusa_command_on_cuda_writes_heads_that_load_on_the_cpu(tmp_path, capsys):
    from rooflm.cli import main
    from rooflm.config import load_model_config
    from rooflm.spec_decode.medusa import load_medusa_heads

    out = tmp_path / "heads"
    rc = main(["train-medusa", "--device", "cuda", "--self-distill", "8", "--distill-len", "32", "--distill-eval",
               "2", "--steps", "4", "--batch-size", "4", "--log-every", "2", "--eval-tokens", "256", "--heads", "3",
               "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "against the model's greedy tokens" in text and "on cuda" in text
    heads, meta = load_medusa_heads(out, load_model_config("smollm2-135m"), device="cpu")
    assert meta["num_heads"] == 3 and heads.weight.device.type == "cpu"
    assert heads.weight.abs().sum() > 0  # trained: the heads start at zero
