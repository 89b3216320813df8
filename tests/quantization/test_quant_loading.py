"""Quantized weights through the loader: round-to-nearest at load time, packed shards into fused projections,
GPTQ/AWQ checkpoints and GGUF files handed to their readers, and one clear error per contradiction."""
from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from rooflm.layers.linear import Linear
from rooflm.loader import load_model
from rooflm.models.weights import WeightTarget, load_named_weights, rows
from rooflm.quantization.packed import dequantize
from rooflm.quantization.rtn import quantize_rtn

PROJ_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                 "up_proj.weight", "down_proj.weight")


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# 0.03 / 0.3: the CPU path's native kernel also rounds the activations to 8 bits per block of 32 (llama.cpp's
# scheme); with torch's kernels (ROOFLM_CPU_NATIVE=off) 0.02 / 0.25 hold
@pytest.mark.parametrize("method,bits,tol", [("w8a16", 8, 0.03), ("w4a16", 4, 0.3)])
def test_rtn_at_load_is_close_to_float_and_packs_every_projection(tiny_checkpoint, logits_of, ids, method, bits,
                                                                   tol):
    ref_model, cfg = load_model(str(tiny_checkpoint), show_progress=False)
    model, _ = load_model(str(tiny_checkpoint), show_progress=False, quantization=method)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * cfg.num_hidden_layers
    assert all(m.packed_weight is not None and m.packed_weight.bits == bits for m in linears)
    assert not model.lm_head.quantized  # the LM head stays float by default
    if bits == 4:  # 128 divides neither 64 nor 96: the largest power-of-two divisor is used
        assert model.model.layers[0].self_attn.qkv_proj.packed_weight.group_size == 64
        assert model.model.layers[0].mlp.down_proj.packed_weight.group_size == 32
    ref, out = logits_of(ref_model, cfg, ids), logits_of(model, cfg, ids)
    assert 0 < _rel_err(out, ref) < tol


def test_packed_shards_into_fused_qkv_equal_float_then_quantize(tiny_checkpoint, logits_of, ids):
    """RTN works row by row, so quantizing q, k, v (and gate, up) separately and stacking the shards gives exactly
    the weights of quantizing the fused projection."""
    from rooflm.loader.safetensors import iter_safetensors, safetensors_files
    from rooflm.quantization.apply import quantize_model
    from rooflm.quantization.config import QuantConfig

    files = safetensors_files(str(tiny_checkpoint))
    float_model, cfg = load_model(str(tiny_checkpoint), show_progress=False)
    quantize_model(float_model, QuantConfig("w4a16", group_size=32))
    packed_model, _ = load_model(str(tiny_checkpoint), load_format="dummy", show_progress=False)

    def stream():
        for name, t in iter_safetensors(files):
            yield (name, quantize_rtn(t, 4, 32)) if name.endswith(PROJ_SUFFIXES) else (name, t)

    packed_model.load_weights(stream())
    a = packed_model.model.layers[1].self_attn.qkv_proj.packed_weight
    b = float_model.model.layers[1].self_attn.qkv_proj.packed_weight
    assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales) and torch.equal(a.mins, b.mins)
    torch.testing.assert_close(logits_of(packed_model, cfg, ids), logits_of(float_model, cfg, ids), rtol=0, atol=0)


def _fused_target():
    layer = Linear(16, 24)
    return layer, {f"{name}.weight": WeightTarget(layer.weight, rows(8 * i, 8)) for i, name in enumerate("qkv")}


def test_packed_shards_arrive_in_any_order():
    layer, targets = _fused_target()
    w = torch.randn(24, 16)
    shards = {"q.weight": w[:8], "k.weight": w[8:16], "v.weight": w[16:]}
    order = ["v.weight", "q.weight", "k.weight"]
    load_named_weights(targets, [(n, quantize_rtn(shards[n], 8)) for n in order], model=layer)
    assert layer.quantized
    torch.testing.assert_close(dequantize(layer.packed_weight), dequantize(quantize_rtn(w, 8)))


def test_float_and_packed_shards_of_one_layer_are_refused():
    layer, targets = _fused_target()
    w = torch.randn(24, 16)
    with pytest.raises(ValueError, match=r"'k.weight' is float but other shards of the same layer were quantized"):
        load_named_weights(targets, [("q.weight", quantize_rtn(w[:8], 8)), ("k.weight", w[8:16])], model=layer)
    layer, targets = _fused_target()
    with pytest.raises(ValueError, match=r"'k.weight' is quantized but other shards of the same layer were float"):
        load_named_weights(targets, [("q.weight", w[:8]), ("k.weight", quantize_rtn(w[8:16], 8))], model=layer)


def test_packed_shard_shape_mismatch_names_the_tensor():
    layer, targets = _fused_target()
    with pytest.raises(ValueError, match=r"'k.weight' has shape \(8, 32\) in the checkpoint, expected \(8, 16\)"):
        load_named_weights(targets, [("k.weight", quantize_rtn(torch.randn(8, 32), 8))], model=layer)


def test_packed_weight_for_a_float_only_place_is_dequantized(tiny_checkpoint):
    """Embeddings and norms have no packed form: a quantized tensor for them is dequantized into the float weight."""
    from rooflm.loader.safetensors import iter_safetensors, safetensors_files

    model, _ = load_model(str(tiny_checkpoint), load_format="dummy", show_progress=False)
    tensors = dict(iter_safetensors(safetensors_files(str(tiny_checkpoint))))
    pw = quantize_rtn(tensors["model.embed_tokens.weight"], 8)
    model.load_weights((n, pw if n == "model.embed_tokens.weight" else t) for n, t in tensors.items())
    torch.testing.assert_close(model.model.embed_tokens.weight.data, dequantize(pw, torch.float32))
    assert not any(m.quantized for m in model.modules() if isinstance(m, Linear))


def test_lm_head_quantized_when_asked(tiny_config, logits_of, ids):
    from rooflm.quantization.config import QuantConfig

    ref_model, cfg = load_model(str(tiny_config), show_progress=False, seed=2)
    model, _ = load_model(str(tiny_config), show_progress=False, seed=2,
                          quantization=QuantConfig("w4a16", group_size=16, lm_head=True))
    assert model.lm_head.packed_weight is not None and model.lm_head.packed_weight.group_size == 16
    assert model.model.layers[0].mlp.down_proj.packed_weight.group_size == 16
    assert 0 < _rel_err(logits_of(model, cfg, ids), logits_of(ref_model, cfg, ids)) < 0.3


def _quantized_checkpoint(folder, method: str) -> dict:
    qc = {"quant_method": method, "bits": 4, "group_size": 32}
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    return qc


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_quantized_checkpoint_goes_through_its_reader(tiny_checkpoint, monkeypatch, logits_of, ids, method):
    """A checkpoint whose config.json carries quantization_config is read by
    rooflm.quantization.checkpoint.iter_quantized_safetensors (here a stand-in that packs the float tensors by RTN:
    the test is of the loader's wiring, not of the GPTQ/AWQ formats)."""
    from rooflm.loader.safetensors import iter_safetensors

    ref_model, cfg = load_model(str(tiny_checkpoint), show_progress=False)
    qc = _quantized_checkpoint(tiny_checkpoint, method)
    seen = {}

    def reader(files, quant_cfg, dtype):
        seen.update(files=files, quant_cfg=quant_cfg, dtype=dtype)
        for name, t in iter_safetensors(files):
            yield (name, quantize_rtn(t, 4, 32)) if name.endswith(PROJ_SUFFIXES) else (name, t)

    fake = types.ModuleType("rooflm.quantization.checkpoint")
    fake.iter_quantized_safetensors = reader
    monkeypatch.setitem(sys.modules, "rooflm.quantization.checkpoint", fake)
    model, _ = load_model(str(tiny_checkpoint), show_progress=False)  # detected without quantization=
    assert seen["quant_cfg"] == qc and seen["dtype"] == torch.float32 and len(seen["files"]) == 1
    assert all(m.packed_weight is not None for m in model.modules() if isinstance(m, Linear))
    assert 0 < _rel_err(logits_of(model, cfg, ids), logits_of(ref_model, cfg, ids)) < 0.25
    load_model(str(tiny_checkpoint), show_progress=False, quantization=method)  # naming it is fine too
    other = "awq" if method == "gptq" else "gptq"
    for bad in (other, "w8a16", "none", "gguf"):
        with pytest.raises(ValueError, match=rf"quantization='{bad}' contradicts the checkpoint.*'{method}'"):
            load_model(str(tiny_checkpoint), show_progress=False, quantization=bad)


def test_unsupported_checkpoint_quantization_method(tiny_checkpoint):
    _quantized_checkpoint(tiny_checkpoint, "bitsandbytes")
    with pytest.raises(ValueError, match=r"quant_method='bitsandbytes'.*not supported"):
        load_model(str(tiny_checkpoint), show_progress=False)


@pytest.mark.parametrize("bad", ["gptq", "awq", "gguf"])
def test_checkpoint_methods_contradict_float_weights(tiny_checkpoint, tiny_config, bad):
    with pytest.raises(ValueError, match=rf"quantization='{bad}' does not apply to a float checkpoint"):
        load_model(str(tiny_checkpoint), show_progress=False, quantization=bad)
    with pytest.raises(ValueError, match=rf"quantization='{bad}' does not apply to random weights"):
        load_model(str(tiny_config), show_progress=False, quantization=bad)


@pytest.mark.parametrize("bad", ["int4", "W8A16", ""])
def test_unknown_quantization_value_lists_the_choices(tiny_config, bad):
    with pytest.raises(ValueError, match=rf"quantization={bad!r} is invalid: expected None or one of none, w8a16, "
                                         r"w4a16, gptq, awq, gguf, fp8"):
        load_model(str(tiny_config), show_progress=False, quantization=bad)


def test_gguf_resolution():
    """GGUF files keep their quantized blocks by default; "none" dequantizes; load-time methods apply to the
    dequantized weights; checkpoint methods contradict the file."""
    from rooflm.config import ModelConfig
    from rooflm.loader import resolve_quantization

    cfg = ModelConfig.from_hf_dict({"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
                                    "num_hidden_layers": 1, "num_attention_heads": 1}, name="x.gguf")
    assert resolve_quantization(None, "gguf", cfg) == "gguf"
    for m in ("gguf", "none", "w8a16", "w4a16", "fp8"):
        assert resolve_quantization(m, "gguf", cfg) == m
    for bad in ("gptq", "awq"):
        with pytest.raises(ValueError, match=rf"quantization='{bad}' does not apply to a GGUF file"):
            resolve_quantization(bad, "gguf", cfg)
    assert resolve_quantization(None, "safetensors", cfg) == "none"


@pytest.mark.parametrize("quantization,keep", [(None, True), ("gguf", True), ("none", False)])
def test_gguf_reader_is_asked_to_keep_blocks_quantized(tmp_path, monkeypatch, quantization, keep):
    """``keep_quantized=True`` goes to rooflm.loader.gguf.iter_gguf_tensors for "gguf" (the default) and is left
    out for "none". The GGUF reading itself is stood in for: the test is of the loader's wiring."""
    import rooflm.loader.gguf as gguf_mod
    from rooflm.loader.dummy import init_dummy_weights

    from rooflm.config import ModelConfig
    from rooflm.models import get_model_class

    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"")
    tiny = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32,
                                     "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                     "num_attention_heads": 2}, name=str(path))
    calls = []

    def fake_iter(reader, c, **kwargs):
        calls.append(kwargs)
        m = get_model_class(c)(c)
        init_dummy_weights(m, seed=0)
        for name, t in m.weight_targets().items():
            w = t.view()
            yield name, (quantize_rtn(w, 8) if kwargs.get("keep_quantized") and name.endswith(PROJ_SUFFIXES) else w)

    monkeypatch.setattr(gguf_mod, "read_gguf_config", lambda p: tiny)
    monkeypatch.setattr(gguf_mod, "open_gguf", lambda p: types.SimpleNamespace(tensors=[]))
    monkeypatch.setattr(gguf_mod, "iter_gguf_tensors", fake_iter)
    model, _ = load_model(str(path), show_progress=False, quantization=quantization)
    assert calls == ([{"keep_quantized": True}] if keep else [{}])
    assert all(m.quantized == keep for m in model.modules() if isinstance(m, Linear))
