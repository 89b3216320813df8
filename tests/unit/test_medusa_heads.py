"""Medusa heads: the residual block's maths, saving and loading, and training on a frozen tiny model (the loss falls
and head 1's held-out accuracy rises on text whose token t + 2 follows from token t)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch.nn import functional as F

from rooflm.spec_decode.medusa import MedusaHeads, load_medusa_heads, model_identity, save_medusa_heads
from rooflm.spec_decode.medusa_train import MedusaTrainConfig, train_medusa

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
        "vocab_size": 16, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rooflm.loader import load_model

    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY))
    return load_model(str(path), load_format="dummy", dtype=torch.float32, device="cpu", show_progress=False,
                      seed=3)


def test_a_head_is_a_residual_silu_block_and_starts_as_the_identity():
    heads = MedusaHeads(3, 8)
    h = torch.randn(5, 8)
    assert torch.equal(heads(h), h.unsqueeze(1).expand(5, 3, 8))  # W = 0, b = 0: SiLU(0) = 0
    with torch.no_grad():
        heads.weight.normal_()
        heads.bias.normal_()
    out = heads(h, 2)
    assert out.shape == (5, 2, 8)
    for i in range(2):
        torch.testing.assert_close(out[:, i], h + F.silu(h @ heads.weight[i].t() + heads.bias[i]))


def test_heads_survive_a_save_and_load(tiny, tmp_path):
    _, cfg = tiny
    heads = MedusaHeads(2, cfg.hidden_size)
    with torch.no_grad():
        heads.weight.normal_()
        heads.bias.normal_()
    save_medusa_heads(heads, tmp_path / "h", model_identity(cfg, "tiny"))
    loaded, meta = load_medusa_heads(tmp_path / "h", cfg)
    assert meta["num_heads"] == 2 and meta["base_model"]["vocab_size"] == 16
    assert torch.equal(loaded.weight, heads.weight) and torch.equal(loaded.bias, heads.bias)
    wider = dataclasses.replace(cfg, hidden_size=64)
    with pytest.raises(ValueError, match="speculative_config.model=.*hidden_size=32, the target 64"):
        load_medusa_heads(tmp_path / "h", wider)


def test_training_lowers_the_loss_and_raises_held_out_accuracy(tiny):
    model, cfg = tiny
    g = torch.Generator().manual_seed(0)
    # A random walk of step +1 or +3 (mod 16): token t + 2 is never t's, and depends on t.
    steps = torch.tensor([1, 3])[torch.randint(0, 2, (3000,), generator=g)]
    ids = (torch.cumsum(steps, 0) % 16).tolist()
    tc = MedusaTrainConfig(num_heads=2, steps=40, lr=3e-2, seq_len=64, batch_size=4, max_train_tokens=1024,
                           eval_tokens=256, log_every=40, warmup_steps=2)
    lines: list[str] = []
    for p in model.parameters():
        p.requires_grad_(False)
    _, summary = train_medusa(model, cfg, ids[:2000], ids[2000:], tc, log=lines.append)
    first, last = sum(summary["losses"][:4]) / 4, sum(summary["losses"][-4:]) / 4
    assert last < 0.8 * first
    before, after = summary["accuracy_before"], summary["accuracy_after"]
    assert after[1] > before[1] + 0.1  # head 1: token t + 2
    assert any(line.startswith("step 40/40: loss") for line in lines)
    assert summary["train_tokens"] == 1024 and summary["eval_tokens"] == 256


def test_bad_training_settings_are_refused():
    with pytest.raises(ValueError, match="MedusaTrainConfig.steps=0"):
        MedusaTrainConfig(steps=0)
    with pytest.raises(ValueError, match="MedusaTrainConfig.seq_len=4"):
        MedusaTrainConfig(num_heads=4, seq_len=4)
    with pytest.raises(ValueError, match="MedusaTrainConfig.lr=-1"):
        MedusaTrainConfig(lr=-1)
