"""``quantization=`` through EngineConfig, LLM and the CLI, and the roofline reading the packed bytes."""
from __future__ import annotations

import argparse

import pytest
import torch

from rooflm.config import EngineConfig
from rooflm.layers.linear import Linear
from rooflm.quantization.config import QUANTIZATION_METHODS, QuantConfig


@pytest.mark.parametrize("bad", ["int8", "W4A16", 4])
def test_engine_config_rejects_unknown_quantization(bad):
    with pytest.raises(ValueError, match=rf"EngineConfig.quantization={bad!r} is invalid: expected None or one of"):
        EngineConfig(quantization=bad)


@pytest.mark.parametrize("method", QUANTIZATION_METHODS)
def test_engine_config_accepts_every_method(method):
    assert EngineConfig(quantization=method).quantization == method


def test_quant_config_defaults_and_errors():
    assert (QuantConfig("w8a16").bits, QuantConfig("w8a16").group_size) == (8, None)
    assert (QuantConfig("w4a16").bits, QuantConfig("w4a16").group_size) == (4, 128)
    with pytest.raises(ValueError, match=r"quantization='int3' is invalid.*none, w8a16, w4a16, gptq, awq, gguf, fp8"):
        QuantConfig("int3")
    with pytest.raises(ValueError, match=r"QuantConfig.bits=4 is invalid for quantization='w8a16'"):
        QuantConfig("w8a16", bits=4)
    with pytest.raises(ValueError, match=r"QuantConfig.group_size=0 is invalid"):
        QuantConfig("w4a16", group_size=0)
    with pytest.raises(ValueError, match=r"QuantConfig.lm_head='yes' is invalid"):
        QuantConfig("w8a16", lm_head="yes")
    assert QuantConfig.parse(None) is None and QuantConfig.parse("fp8").method == "fp8"


def test_cli_flag_and_help_list_every_method():
    from rooflm.entrypoints.args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    action = next(a for a in parser._actions if a.dest == "quantization")
    assert all(m in action.help for m in QUANTIZATION_METHODS) and "default: what the checkpoint holds" in action.help
    args = parser.parse_args(["--quantization", "w4a16", "--threads", "1"])
    assert engine_config_from_args(args).quantization == "w4a16"


def _llm(tiny_config, quantization):
    from rooflm import LLM

    return LLM(model=str(tiny_config), load_format="dummy", device="cpu", quantization=quantization, seed=3,
               kv_cache_memory=2**20, max_model_len=64, show_progress=False)


def test_llm_generates_with_w8a16_end_to_end(tiny_config, ids):
    from rooflm import SamplingParams

    llm = _llm(tiny_config, "w8a16")
    model = llm.engine.model
    assert all(m.packed_weight is not None and m.packed_weight.bits == 8
               for m in model.modules() if isinstance(m, Linear))
    out = llm.generate([ids], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5


def test_packed_model_reports_smaller_weight_bytes_to_the_roofline(tiny_config):
    """The live roofline of a quantized engine counts the packed bytes (codes, scales, mins), so a decode step's
    best possible time, memory-bound, is smaller than the float model's on the same ceilings."""
    from rooflm.quantization.apply import projection_weight_bytes, weight_format
    from rooflm.roofline.live import LiveRoofline

    f_llm, q_llm = _llm(tiny_config, None), _llm(tiny_config, "w4a16")
    f_bytes, elems = projection_weight_bytes(f_llm.engine.model)
    q_bytes, q_elems = projection_weight_bytes(q_llm.engine.model)
    assert q_elems == elems and f_bytes == 4 * elems
    want = sum(m.packed_weight.nbytes for m in q_llm.engine.model.modules() if isinstance(m, Linear))
    assert q_bytes == want < f_bytes / 6  # 4-bit codes plus float32 scales and mins per group of 32 or 64
    fmt = weight_format(q_llm.engine.model)
    assert fmt.name == "4" and fmt.bytes == q_bytes / elems
    assert weight_format(f_llm.engine.model) is None
    hw = q_llm.engine.roofline.hardware
    float_bound = LiveRoofline(f_llm.engine.model_config, torch.float32, hw)
    decode = ([1], [40], 1)
    assert q_llm.engine.roofline.predict(*decode) < float_bound.predict(*decode)
    same = LiveRoofline(q_llm.engine.model_config, torch.float32, hw, weight_format=fmt)
    assert q_llm.engine.roofline.predict(*decode) == same.predict(*decode)
    with pytest.raises(ValueError, match="weight_format='4' is invalid"):
        LiveRoofline(q_llm.engine.model_config, torch.float32, hw, weight_format="4")


def test_bench_roofline_bounds_use_the_packed_weight_bytes(tiny_config):
    """bench latency's analytic bound reads the same measured format: fewer weight bytes, a shorter decode step."""
    from rooflm.bench.latency import roofline_bounds
    from rooflm.config import load_model_config
    from rooflm.loader import load_model
    from rooflm.quantization.apply import projection_weight_bytes, weight_format

    model, cfg = load_model(str(tiny_config), show_progress=False, quantization="w8a16")
    ceilings = {"device": "test", "copy_gbps": 10.0, "matmul_tflops": 1.0}
    fmt = weight_format(model)
    assert fmt.name == "8"
    plain = roofline_bounds(load_model_config(str(tiny_config)), ceilings, 1, 8, 4)
    quant = roofline_bounds(cfg, ceilings, 1, 8, 4, w_bits=fmt)
    q_bytes, elems = projection_weight_bytes(model)
    # the projections' share of the weight bytes shrinks from 2 bytes (16-bit) to the measured bytes per element
    assert plain["weights_bytes"] - quant["weights_bytes"] == pytest.approx(2 * elems - q_bytes)
    assert quant["decode_step_bytes"] < plain["decode_step_bytes"]
    assert quant["tpot_s"] < plain["tpot_s"]


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_bench_roofline_bounds_count_the_quantized_kv_bytes(kv):
    """bench latency's bound for an int8 / fp8 KV cache moves 1 byte per value plus one float32 scale per token and
    head: the decode step's KV bytes shrink by (head_dim + 4) / (2 * head_dim) against float16, the weights do not."""
    from rooflm.bench.latency import kv_format, roofline_bounds
    from rooflm.config import load_model_config

    cfg = load_model_config("llama-2-7b")
    ceilings = {"device": "test", "copy_gbps": 1000.0, "matmul_tflops": 100.0}
    fmt = kv_format(cfg.head_dim, "float16", kv)
    assert fmt.bytes == pytest.approx((cfg.head_dim + 4) / cfg.head_dim)
    assert kv_format(cfg.head_dim, "float16", "auto") == "16"
    args = (cfg, ceilings, 4, 4000, 2)
    f16, zero = roofline_bounds(*args), roofline_bounds(cfg, ceilings, 4, 1, 2)
    q = roofline_bounds(*args, kv_bits=fmt)
    assert q["weights_bytes"] == f16["weights_bytes"]
    kv16 = f16["decode_step_bytes"] - zero["decode_step_bytes"]  # the KV part of a decode step, roughly
    saved = f16["decode_step_bytes"] - q["decode_step_bytes"]
    assert saved == pytest.approx(kv16 * (1 - (cfg.head_dim + 4) / (2 * cfg.head_dim)), rel=0.01)
    assert q["tpot_s"] < f16["tpot_s"]


def test_bench_cli_takes_quantization():
    from rooflm.bench import latency, throughput

    for mod in (latency, throughput):
        parser = argparse.ArgumentParser()
        mod.add_arguments(parser)
        assert parser.parse_args(["--quantization", "w4a16"]).quantization == "w4a16"
        assert parser.parse_args([]).quantization is None
