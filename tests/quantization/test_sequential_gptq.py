"""Sequential GPTQ (Frantar et al. 2023): the layer-by-layer forward it calibrates with computes exactly what the
model computes, layer 1's Hessian comes from the quantized layer 0's outputs, 8 bits keep the float model's
function, and the flag is refused where it does not apply."""
import pytest
import torch

from rooflm.cli import main
from rooflm.quantization.calibration import collect_stats
from rooflm.quantization.pipeline import QuantizeConfig, quantize_model
from rooflm.quantization.sequential import TRUE_SEQUENTIAL, LayerRunner, sequential_gptq
from test_quantize_model import _config, _hidden, _load
from test_quantize_model import _windows as _shared_windows


def _path(tmp_path) -> str:
    return _config(tmp_path, num_hidden_layers=3)


def _windows(cfg, num_samples=3, seq_len=40):  # 40: the last KV-cache block only partly filled
    return _shared_windows(cfg, num_samples, seq_len)


def test_layer_by_layer_forward_is_the_model_forward(tmp_path):
    model, cfg = _load(_path(tmp_path))
    windows = _windows(cfg)
    with torch.no_grad():
        runner = LayerRunner(model, cfg.num_key_value_heads, cfg.head_dim, windows)
        for i in range(cfg.num_hidden_layers):
            runner.advance(i)
        got = runner.final_hidden()
    for ids, h in zip(windows, got, strict=True):
        assert torch.equal(h, _hidden(model, cfg, ids))


def test_collect_without_quantizing_gives_the_one_pass_hessians(tmp_path):
    model, cfg = _load(_path(tmp_path))
    windows = _windows(cfg)
    one_pass = collect_stats(model, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, windows,
                             hessian=True)
    with torch.no_grad():
        runner = LayerRunner(model, cfg.num_key_value_heads, cfg.head_dim, windows)
        for i in range(cfg.num_hidden_layers):
            layer = model.model.layers[i]
            for proj in TRUE_SEQUENTIAL:
                name = f"model.layers.{i}.{proj}"
                mod = layer.get_submodule(proj)
                h = runner.collect(i, {name: mod})[name].hessian()
                torch.testing.assert_close(h, one_pass[name].hessian.hessian(), rtol=1e-5, atol=1e-6)
            runner.advance(i)


def test_hessians_after_layer_zero_come_from_the_quantized_layers(tmp_path):
    model, cfg = _load(_path(tmp_path))
    windows = _windows(cfg)
    one_pass = collect_stats(model, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, windows,
                             hessian=True)
    seen = {}

    def quantize(w, h):
        seen[len(seen)] = h.clone()
        return _gptq(w, h, bits=4)

    float_w = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        result = sequential_gptq(model, cfg.num_key_value_heads, cfg.head_dim, windows, quantize)
    order = [f"model.layers.{i}.{p}" for i in range(cfg.num_hidden_layers) for p in TRUE_SEQUENTIAL]
    assert list(result) == order
    hessians = dict(zip(order, seen.values(), strict=True))
    # layer 0's qkv_proj reads the embeddings, which nothing quantized touches
    first = "model.layers.0.self_attn.qkv_proj"
    torch.testing.assert_close(hessians[first], one_pass[first].hessian.hessian(), rtol=1e-5, atol=1e-6)
    for name in order[1:]:  # every later projection reads through at least one quantized projection
        h, ref = hessians[name], one_pass[name].hessian.hessian()
        assert (h - ref).abs().max() > 1e-3 * ref.abs().max(), name
    # the model holds the dequantized weights; every other tensor is untouched
    for name, q in result.items():
        assert torch.equal(model.get_submodule(name).weight, q.dequantize())
    for n, p in model.named_parameters():
        if not n.endswith("proj.weight"):
            assert torch.equal(p, float_w[n]), n


def _gptq(w, h, bits):
    from rooflm.quantization.gptq import gptq_quantize

    return gptq_quantize(w, h, bits, 32, desc_act=True, search_grid=True)


@pytest.mark.parametrize("desc_act", [False, True])
def test_eight_bit_sequential_keeps_the_float_outputs(tmp_path, desc_act):
    path = _path(tmp_path)
    model, cfg = _load(path)
    original, _ = _load(path)
    ids = list(range(7, 57))
    want = _hidden(original, cfg, ids)
    qcfg = QuantizeConfig(method="gptq", bits=8, group_size=32, desc_act=desc_act, sequential=True)
    result = quantize_model(model, cfg, qcfg, _windows(cfg))
    assert len(result.quantized) == 7 * cfg.num_hidden_layers
    assert not any(name.endswith("proj.weight") for name in result.float_state)
    assert torch.equal(result.float_state["model.embed_tokens.weight"], original.model.embed_tokens.weight)
    err = (_hidden(model, cfg, ids) - want).abs().max().item()
    assert 0 < err < 0.02 * want.abs().max().item()
    # the restored checkpoint computes the same: the model's projections hold exactly the quantized weights
    restored, _ = _load(path)
    restored.load_weights(list(result.float_state.items())
                          + [(f"{m}.weight", q.dequantize()) for m, q in result.quantized.items()])
    assert torch.equal(_hidden(restored, cfg, ids), _hidden(model, cfg, ids))


def test_four_bit_sequential_differs_from_one_pass_and_is_as_close(tmp_path):
    path = _path(tmp_path)
    original, cfg = _load(path)
    ids = list(range(7, 57))
    want = _hidden(original, cfg, ids)
    errs = {}
    for sequential in (False, True):
        model, _ = _load(path)
        qcfg = QuantizeConfig(method="gptq", bits=4, group_size=32, sequential=sequential)
        result = quantize_model(model, cfg, qcfg, _windows(cfg, num_samples=4))
        restored, _ = _load(path)
        restored.load_weights(list(result.float_state.items())
                              + [(f"{m}.weight", q.dequantize()) for m, q in result.quantized.items()])
        errs[sequential] = (_hidden(restored, cfg, ids) - want).abs().max().item(), result
    codes = [{m: q.codes for m, q in r.quantized.items()} for _, r in errs.values()]
    first = "model.layers.0.self_attn.q_proj"  # same Hessian both ways
    assert torch.equal(codes[0][first], codes[1][first])
    assert not torch.equal(codes[0]["model.layers.2.mlp.down_proj"], codes[1]["model.layers.2.mlp.down_proj"])
    assert errs[True][0] < 0.3 * want.abs().max().item()


def test_config_default_and_refusals():
    from rooflm.quantization.pipeline import SEQUENTIAL_DEFAULT

    assert QuantizeConfig(method="gptq").sequential is SEQUENTIAL_DEFAULT
    assert QuantizeConfig(method="gptq", sequential=True).sequential is True
    assert QuantizeConfig(method="gptq", sequential=False).sequential is False
    assert QuantizeConfig(method="awq").sequential is False and QuantizeConfig(method="rtn").sequential is False
    for method in ("rtn", "awq"):
        with pytest.raises(ValueError, match=f"sequential=True .* method='{method}'"):
            QuantizeConfig(method=method, sequential=True)


@pytest.mark.parametrize("argv", [["--method", "awq", "--sequential"], ["--method", "rtn", "--no-sequential"],
                                  ["--method", "awq", "--no-sequential"]])
def test_cli_refuses_the_flag_outside_gptq(tmp_path, capsys, argv):
    rc = main(["quantize", _path(tmp_path), "--out", str(tmp_path / "out"), "--num-samples", "2", *argv])
    assert rc == 2
    err = capsys.readouterr().err
    assert argv[-1] in err and f"--method {argv[1]}" in err
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.parametrize("flag", ["--sequential", "--no-sequential"])
def test_cli_flag_chooses_the_calibration(tmp_path, flag):
    from safetensors.torch import load_file

    path = _path(tmp_path)
    common = ["--method", "gptq", "--group-size", "32", "--num-samples", "2", "--seq-len", "32", "--threads",
              str(torch.get_num_threads())]
    assert main(["quantize", path, *common, flag, "--out", str(tmp_path / "flag")]) == 0
    got = load_file(str(tmp_path / "flag" / "model.safetensors"))
    model, cfg = _load(path)
    qcfg = QuantizeConfig(method="gptq", group_size=32, num_samples=2, seq_len=32, min_zero=1,
                          sequential=flag == "--sequential")
    result = quantize_model(model, cfg, qcfg, _windows(cfg, num_samples=2, seq_len=32))
    from rooflm.quantization.formats import to_gptq

    for module, q in result.quantized.items():
        assert torch.equal(got[f"{module}.qweight"], to_gptq(q)["qweight"]), module
