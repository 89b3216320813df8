"""GPTQ / AWQ checkpoint folders: the writer's config and tensors, the reader's grouping across shards, and a clear
error for every way a checkpoint can disagree with its declared format."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from rooflm.quantization.checkpoint import (
    QuantFormat, iter_quantized_safetensors, quantization_config, save_quantized_checkpoint,
)
from rooflm.quantization.formats import IntQuant, to_awq, to_gptq
from rooflm.quantization.packed import PackedWeight, dequantize
from rooflm.quantization.rtn import quantize_rtn

MODULE = "model.layers.0.mlp.up_proj"
GPTQ_CFG = quantization_config("gptq", 4, 32)
AWQ_CFG = quantization_config("awq", 4, 32)


def _intquant(n=16, k=64, g=32, bits=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return IntQuant(codes=torch.randint(0, 2 ** bits, (n, k), generator=gen, dtype=torch.int16),
                    scales=(torch.rand(n, k // g, generator=gen) + 0.1).half().float(),
                    zeros=torch.randint(1, 2 ** bits, (n, k // g), generator=gen, dtype=torch.int16),
                    bits=bits, group_size=g)


def _write(tmp_path, tensors: dict, name="model.safetensors") -> str:
    path = str(tmp_path / name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    return path


def _read(files, cfg, dtype=torch.float32):
    return dict(iter_quantized_safetensors(files, cfg, dtype))


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_writer_and_reader_round_trip(tmp_path, fmt):
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.json").write_text("{}")
    (src / "tokenizer_config.json").write_text("{}")
    iq = _intquant()
    packed = quantize_rtn(torch.randn(8, 64), 4, 32, dtype=torch.float32)
    norm = torch.rand(64)
    out = tmp_path / "out"
    path = save_quantized_checkpoint(str(out), {"model.norm.weight": norm},
                                     {MODULE: iq, "model.layers.0.mlp.gate_proj": packed},
                                     {"architectures": ["LlamaForCausalLM"], "hidden_size": 64}, fmt, 4, 32,
                                     fmt=fmt, checkpoint_format="gptq_v2" if fmt == "gptq" else "gptq",
                                     tokenizer_source=str(src))
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == fmt and qc["bits"] == 4 and qc["group_size"] == 32
    assert config["architectures"] == ["LlamaForCausalLM"] and config["hidden_size"] == 64
    if fmt == "awq":
        assert qc["version"] == "gemm" and qc["zero_point"] is True
    else:
        assert qc["desc_act"] is False and qc["checkpoint_format"] == "gptq_v2"
    assert (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists()
    raw = load_file(path)
    assert raw[f"{MODULE}.scales"].dtype == torch.float16 and raw[f"{MODULE}.qweight"].dtype == torch.int32
    assert (f"{MODULE}.g_idx" in raw) == (fmt == "gptq")
    read = _read([path], qc)
    assert torch.equal(read["model.norm.weight"], norm.half())
    assert torch.equal(read[f"{MODULE}.weight"].qweight, iq.to_packed(torch.float32).qweight)
    assert torch.allclose(dequantize(read[f"{MODULE}.weight"]), iq.dequantize())
    assert torch.allclose(dequantize(read["model.layers.0.mlp.gate_proj.weight"]), dequantize(packed), rtol=2e-3,
                          atol=1e-4)


def test_module_split_across_shards_is_yielded_once_complete(tmp_path):
    t = to_gptq(_intquant())
    a = _write(tmp_path, {f"{MODULE}.qweight": t["qweight"], "model.norm.weight": torch.ones(4)}, "a.safetensors")
    b = _write(tmp_path, {f"{MODULE}.qzeros": t["qzeros"], f"{MODULE}.scales": t["scales"],
                          f"{MODULE}.g_idx": t["g_idx"]}, "b.safetensors")
    items = list(iter_quantized_safetensors([a, b], GPTQ_CFG, torch.float16))
    names = [n for n, _ in items]
    assert sorted(names) == sorted(["model.norm.weight", f"{MODULE}.weight"])
    pw = dict(items)[f"{MODULE}.weight"]
    assert isinstance(pw, PackedWeight) and pw.scales.dtype == torch.float16


def test_missing_qzeros_names_the_tensor(tmp_path):
    t = to_gptq(_intquant())
    path = _write(tmp_path, {f"{MODULE}.qweight": t["qweight"], f"{MODULE}.scales": t["scales"]})
    with pytest.raises(ValueError, match=f"{MODULE}.qzeros is missing"):
        _read([path], GPTQ_CFG)


def test_missing_qweight_names_the_tensor(tmp_path):
    t = to_gptq(_intquant())
    path = _write(tmp_path, {f"{MODULE}.qzeros": t["qzeros"], f"{MODULE}.scales": t["scales"]})
    with pytest.raises(ValueError, match=f"{MODULE}.qweight is missing"):
        _read([path], GPTQ_CFG)


def test_wrong_scales_shape_names_module_and_tensor(tmp_path):
    t = to_gptq(_intquant())
    t["scales"] = t["scales"][:, :8]
    path = _write(tmp_path, {f"{MODULE}.{k}": v for k, v in t.items()})
    with pytest.raises(ValueError, match=f"{MODULE}.*scales has shape"):
        _read([path], GPTQ_CFG)


def test_qweight_of_the_wrong_dtype_is_rejected(tmp_path):
    t = to_awq(_intquant())
    t["qweight"] = t["qweight"].to(torch.int64)
    path = _write(tmp_path, {f"{MODULE}.{k}": v for k, v in t.items()})
    with pytest.raises(ValueError, match=f"{MODULE}.qweight has dtype"):
        _read([path], AWQ_CFG)


def test_awq_tensors_read_with_a_gptq_config_fail_on_shape(tmp_path):
    t = to_awq(_intquant())
    path = _write(tmp_path, {f"{MODULE}.{k}": v for k, v in t.items()})
    with pytest.raises(ValueError, match="gptq checkpoint, module"):
        _read([path], GPTQ_CFG)


@pytest.mark.parametrize("cfg,field", [
    ({**GPTQ_CFG, "bits": 3}, "bits=3"),
    ({**AWQ_CFG, "bits": 8}, "bits=8"),
    ({**AWQ_CFG, "version": "gemv"}, "version='gemv'"),
    ({**AWQ_CFG, "zero_point": False}, "zero_point"),
    ({**GPTQ_CFG, "checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
    ({**GPTQ_CFG, "group_size": 0}, "group_size=0"),
    ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
])
def test_unsupported_config_fields_are_named(cfg, field):
    with pytest.raises(ValueError, match=f"quantization_config.{field}".replace("(", r"\(")):
        QuantFormat.from_config(cfg)


def test_gptq_v1_zeros_are_stored_minus_one_and_read_back(tmp_path):
    iq = _intquant(seed=4)
    t = to_gptq(iq, "gptq")
    t2 = to_gptq(iq, "gptq_v2")
    assert not torch.equal(t["qzeros"], t2["qzeros"])
    path = _write(tmp_path, {f"{MODULE}.{k}": v for k, v in t.items()})
    pw = _read([path], GPTQ_CFG)[f"{MODULE}.weight"]
    assert torch.allclose(dequantize(pw), iq.dequantize())
    pw2 = _read([path], {**GPTQ_CFG, "checkpoint_format": "gptq_v2"})[f"{MODULE}.weight"]
    assert not torch.allclose(dequantize(pw2), iq.dequantize())  # read as gptq_v2: every zero point one lower
