"""Whole-model quantization on tiny random Llama configs: AWQ's folding keeps the float model's function, the
Hugging Face module names come out whole, and ``rooflm quantize`` writes a folder that reads back into exactly the
weights the algorithm produced."""
import json
import os

import pytest
import torch

from rooflm.cli import main
from rooflm.loader import load_model
from rooflm.quantization.calibration import calibration_windows, read_calibration_text, tokenize_calibration
from rooflm.quantization.checkpoint import iter_quantized_safetensors
from rooflm.quantization.packed import PackedWeight, dequantize
from rooflm.quantization.pipeline import QuantizeConfig, quantize_model
from rooflm.quantization.zeropoint import quantize_int

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
HF_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj", "mlp.down_proj")


def _config(tmp_path, **over) -> str:
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({**TINY, **over}))
    return str(path)


def _load(path):
    return load_model(path, dtype=torch.float32, attn_backend="torch", ops="native", show_progress=False)


def _windows(cfg, num_samples=2, seq_len=32):
    ids = tokenize_calibration(read_calibration_text(), None, cfg.vocab_size)
    return calibration_windows(ids, num_samples, seq_len)


def _hidden(model, cfg, ids):
    """The final hidden states of one prefill of ``ids``."""
    from rooflm.attention.metadata_utils import allocate_kv_caches, single_sequence_metadata

    caches = allocate_kv_caches(cfg.num_hidden_layers, 4, 16, cfg.num_key_value_heads, cfg.head_dim)
    meta, pos = single_sequence_metadata(0, len(ids), 16)
    with torch.no_grad():
        return model(torch.tensor(ids), pos, caches, meta)


def _logits(model, cfg, ids):
    with torch.no_grad():
        return model.compute_logits(_hidden(model, cfg, ids))


@pytest.mark.parametrize("kv_heads", [2, 4])  # grouped-query (o_proj unscaled) and multi-head (o_proj into v)
def test_awq_folding_keeps_the_float_model_and_scales_the_weights(tmp_path, kv_heads):
    model, cfg = _load(_config(tmp_path, num_key_value_heads=kv_heads))
    # outlier channels in the residual stream make AWQ pick non-trivial scales
    model.model.embed_tokens.weight.data[:, ::8] *= 40
    ids = list(range(3, 40))
    before = _logits(model, cfg, ids)
    w_before = model.model.layers[0].self_attn.qkv_proj.weight.detach().clone()
    result = quantize_model(model, cfg, QuantizeConfig(method="awq", group_size=32), _windows(cfg))
    after = _logits(model, cfg, ids)
    assert torch.allclose(after, before, rtol=1e-4, atol=1e-4 * before.abs().max().item())
    assert any(a > 0 for a in result.alphas.values())
    assert not torch.allclose(model.model.layers[0].self_attn.qkv_proj.weight, w_before)
    has_o = any(name.endswith("o_proj") for name in result.alphas)
    assert has_o == (kv_heads == cfg.num_attention_heads)


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_quantize_model_covers_every_hf_projection(tmp_path, method):
    model, cfg = _load(_config(tmp_path))
    float_w = model.model.layers[1].self_attn.qkv_proj.weight.detach().clone()
    result = quantize_model(model, cfg, QuantizeConfig(method=method, group_size=32), _windows(cfg))
    want = {f"model.layers.{i}.{m}" for i in range(cfg.num_hidden_layers) for m in HF_MODULES}
    assert set(result.quantized) == want
    assert "model.embed_tokens.weight" in result.float_state and "model.norm.weight" in result.float_state
    assert not any(name.endswith("proj.weight") for name in result.float_state)
    q = result.quantized["model.layers.1.self_attn.k_proj"]
    assert q.codes.shape == (cfg.num_key_value_heads * cfg.head_dim, cfg.hidden_size)
    rows = slice(cfg.num_attention_heads * cfg.head_dim, (cfg.num_attention_heads + 2) * cfg.head_dim)
    if method == "rtn":  # k_proj is its row range of the fused qkv_proj
        assert torch.equal(q.codes, quantize_int(float_w[rows], 4, 32, search=True).codes)  # the default grid
    elif method == "gptq":  # error feedback moves weights by more than a step, but far less than other rows differ
        err = (q.dequantize() - float_w[rows]).abs().mean()
        assert err < 0.25 * (q.dequantize() - float_w[: rows.stop - rows.start]).abs().mean()


@pytest.mark.parametrize("method,extra", [("gptq", []), ("gptq", ["--desc-act", "--bits", "8"]), ("awq", []),
                                          ("rtn", ["--format", "awq"]), ("awq", ["--format", "gptq"])])
def test_cli_writes_what_the_algorithm_produced(tmp_path, method, extra):
    path = _config(tmp_path)
    out = tmp_path / "out"
    # the same thread count as the comparison below: float sums in another order could flip a rounding
    rc = main(["quantize", path, "--method", method, "--group-size", "32", "--num-samples", "2", "--seq-len", "32",
               "--threads", str(torch.get_num_threads()), "--out", str(out), *extra])
    assert rc == 0
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    fmt = "awq" if ("awq" in extra or (method == "awq" and "gptq" not in extra)) else "gptq"
    assert qc["quant_method"] == fmt and qc["group_size"] == 32
    read = dict(iter_quantized_safetensors([str(out / "model.safetensors")], qc, torch.float32))

    bits = 8 if "8" in extra else 4
    model, cfg = _load(path)
    qcfg = QuantizeConfig(method=method, bits=bits, group_size=32, desc_act="--desc-act" in extra,
                          num_samples=2, seq_len=32, min_zero=1 if fmt == "gptq" else 0)
    result = quantize_model(model, cfg, qcfg, _windows(cfg) if method != "rtn" else None)
    assert {n for n, v in read.items() if isinstance(v, PackedWeight)} == {f"{m}.weight" for m in result.quantized}
    for module, iq in result.quantized.items():
        got, want = read[f"{module}.weight"], iq.to_packed(torch.float32)
        assert torch.equal(got.qweight, want.qweight), module
        assert torch.equal(got.scales, want.scales) and got.bits == bits
        assert (got.mins is None) == (want.mins is None)
        if got.mins is not None:
            assert torch.equal(got.mins, want.mins)
        assert (got.perm is None) == (want.perm is None)
        assert torch.allclose(dequantize(got), iq.dequantize(), atol=1e-6)
    if "--desc-act" in extra:
        assert any(v.perm is not None for v in read.values() if isinstance(v, PackedWeight))
    norm = read["model.layers.0.input_layernorm.weight"]
    assert norm.dtype == torch.float16
    assert torch.equal(norm, result.float_state["model.layers.0.input_layernorm.weight"].half())


@pytest.mark.parametrize("argv,flag", [
    (["--bits", "3"], "--bits"),
    (["--method", "smoothquant"], "--method"),
    (["--group-size", "0"], "--group-size"),
    (["--group-size", "48"], "--group-size"),
    (["--num-samples", "0"], "--num-samples"),
    (["--method", "awq", "--bits", "8"], "--bits"),
    (["--method", "awq", "--desc-act"], "--desc-act"),
    (["--seq-len", "100000"], "--seq-len"),
    (["--method", "gptq", "--calib", "no-such-file.txt"], "--calib"),
    (["--method", "rtn", "--calib", __file__], "--calib"),
    (["--method", "gptq", "--calib", __file__, "missing-second.txt"], "--calib"),
])
def test_cli_bad_flags_name_the_flag(tmp_path, capsys, argv, flag):
    path = _config(tmp_path)
    try:
        rc = main(["quantize", path, "--out", str(tmp_path / "out"), "--num-samples", "2", *argv])
    except SystemExit as e:  # argparse rejects the value itself
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert flag in err and argv[-1] in err
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_cli_joins_several_calibration_files_in_order(tmp_path):
    from safetensors.torch import load_file

    path = _config(tmp_path)
    a, b, ab = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "ab.txt"
    a.write_text("In the beginning was the word. " * 20)
    b.write_text("It is a truth universally acknowledged. " * 20)
    ab.write_text(a.read_text() + "\n\n" + b.read_text())
    outs = {}
    for name, files in (("two", [str(a), str(b)]), ("joined", [str(ab)]), ("one", [str(a)])):
        assert main(["quantize", path, "--method", "gptq", "--group-size", "32", "--num-samples", "4", "--seq-len",
                     "64", "--calib", *files, "--out", str(tmp_path / name)]) == 0
        outs[name] = load_file(str(tmp_path / name / "model.safetensors"))
    assert all(torch.equal(t, outs["joined"][n]) for n, t in outs["two"].items())
    assert not all(torch.equal(t, outs["one"][n]) for n, t in outs["two"].items())


@pytest.mark.parametrize("method,bits", [("gptq", 8), ("awq", 4), ("rtn", 8)])
def test_written_checkpoint_dequantized_computes_the_float_model(tmp_path, method, bits):
    """The folder, dequantized into a float model of the same config, gives the original model's logits up to the
    quantization error: every module's rows, zero points and (for AWQ) folded norms landed where they belong."""
    path = _config(tmp_path)
    out = tmp_path / "out"
    fmt = ["--format", "gptq"] if bits == 8 else []
    assert main(["quantize", path, "--method", method, "--bits", str(bits), "--group-size", "32",
                 "--num-samples", "2", "--seq-len", "32", "--out", str(out), *fmt]) == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    weights = [(name, dequantize(v) if isinstance(v, PackedWeight) else v.float())
               for name, v in iter_quantized_safetensors([str(out / "model.safetensors")], qc, torch.float32)]
    original, cfg = _load(path)
    restored, _ = _load(path)
    restored.load_weights(weights)
    ids = list(range(5, 45))
    want, got = _logits(original, cfg, ids), _logits(restored, cfg, ids)
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    # 8-bit: float16 weights and 8-bit codes; 4-bit: a coarser grid, still far from a misplaced tensor's O(1) error
    assert err < (0.02 if bits == 8 else 0.2) * scale
    shuffled, _ = _load(path)
    shuffled.load_weights([(n, t.flip(0) if n.endswith("v_proj.weight") else t) for n, t in weights])
    assert (_logits(shuffled, cfg, ids) - want).abs().max().item() > err


@pytest.mark.parametrize("search", [True, False])
def test_cli_reads_a_hf_folder_and_copies_its_tokenizer_files(tmp_path, search):
    # --no-grid-search: each group's grid from its min and max (the searched grid is the default)
    from safetensors.torch import save_file

    model, _ = _load(_config(tmp_path))
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(TINY))
    save_file({n: t.view().contiguous() for n, t in model.weight_targets().items()}, str(src / "model.safetensors"))
    (src / "generation_config.json").write_text('{"do_sample": false}')  # copied; no tokenizer to load
    out = tmp_path / "out"
    assert main(["quantize", str(src), "--method", "rtn", "--group-size", "-1", "--out", str(out),
                 *([] if search else ["--no-grid-search"])]) == 0
    assert (out / "generation_config.json").read_text() == '{"do_sample": false}'
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["group_size"] == -1
    read = dict(iter_quantized_safetensors([str(out / "model.safetensors")], qc, torch.float32))
    pw = read["model.layers.0.mlp.down_proj.weight"]
    assert pw.group_size == TINY["intermediate_size"] and pw.scales.shape == (TINY["hidden_size"], 1)
    ref = quantize_int(model.model.layers[0].mlp.down_proj.weight, 4, TINY["intermediate_size"], min_zero=1,
                       search=search)
    assert torch.equal(pw.qweight, ref.to_packed(torch.float32).qweight)


def test_cli_refuses_an_already_quantized_folder(tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quantize", _config(tmp_path), "--method", "rtn", "--out", str(out)]) == 0
    assert main(["quantize", str(out), "--method", "rtn", "--out", str(tmp_path / "again")]) == 2
    assert "already quantized" in capsys.readouterr().err


def test_mixture_of_experts_is_refused(tmp_path):
    path = _config(tmp_path, architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4,
                   num_experts_per_tok=2)
    model, cfg = _load(path)
    with pytest.raises(ValueError, match="num_local_experts=4"):
        quantize_model(model, cfg, QuantizeConfig(method="rtn", group_size=32))


def test_cli_thread_count_is_restored(tmp_path, capsys):
    from rooflm.quantization.cli import idle_cores

    assert 1 <= idle_cores() <= (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    before = torch.get_num_threads()
    other = 2 if before == 1 else 1
    assert main(["quantize", _config(tmp_path), "--method", "rtn", "--threads", str(other),
                 "--out", str(tmp_path / "out")]) == 0
    assert f"{other} threads" in capsys.readouterr().err
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("method,extra", [("gptq", ["--desc-act"]), ("awq", []), ("rtn", ["--bits", "8"])])
def test_written_checkpoint_loads_packed_and_computes_its_dequantized_weights(tmp_path, method, extra):
    """``load_model`` on a folder ``rooflm quantize`` wrote keeps the projections packed (fused q/k/v and gate/up
    shards included) and computes what the same weights dequantized into a float model compute."""
    path = _config(tmp_path)
    out = tmp_path / "out"
    argv = ["quantize", path, "--method", method, "--group-size", "32", "--num-samples", "2", "--seq-len", "32",
            "--out", str(out), *extra]
    assert main(argv if "--bits" in extra else argv + ["--bits", "4"]) == 0
    packed, cfg = load_model(str(out), dtype=torch.float32, attn_backend="torch", ops="native", show_progress=False)
    layer = packed.model.layers[0]
    assert layer.self_attn.qkv_proj.quantized and layer.mlp.gate_up_proj.quantized
    assert (layer.self_attn.qkv_proj.packed_weight.perm is not None) == ("--desc-act" in extra)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    weights = [(name, dequantize(v) if isinstance(v, PackedWeight) else v.float())
               for name, v in iter_quantized_safetensors([str(out / "model.safetensors")], qc, torch.float32)]
    restored, _ = _load(path)
    restored.load_weights(weights)
    ids = list(range(5, 45))
    torch.testing.assert_close(_logits(packed, cfg, ids), _logits(restored, cfg, ids), rtol=1e-4, atol=1e-4)
    wrong = "awq" if method != "awq" else "gptq"
    with pytest.raises(ValueError, match="quantization"):
        load_model(str(out), quantization=wrong, show_progress=False)


def test_cli_quantizes_the_default_gguf_from_its_dequantized_weights(tmp_path, default_model_path):
    """A GGUF file loads packed by default; ``rooflm quantize`` must start from its dequantized float weights."""
    out = tmp_path / "out"
    assert main(["quantize", default_model_path, "--method", "rtn", "--bits", "8", "--out", str(out)]) == 0
    packed, cfg = load_model(str(out), show_progress=False)
    assert packed.model.layers[0].mlp.gate_up_proj.packed_weight.bits == 8
    assert cfg.num_hidden_layers == 30
