"""Before loading a model, `bench latency` and `bench throughput` say what it costs (the analyzer's memory and time
on the measured ceilings) and refuse a run that cannot fit, or a long one without --yes. Nothing is timed here: the
ceilings and the free memory are given, and building an engine fails the test."""
from __future__ import annotations

import pytest

from rooflm.bench import preflight
from rooflm.cli import main
from rooflm.config import load_model_config

CPU_CEILINGS = {"device": "cpu", "copy_gbps": 10.0, "matmul_tflops": 0.1}
GiB = 2**30


@pytest.fixture
def no_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("rooflm.engine.engine.LLMEngine.__init__", refuse)
    monkeypatch.setattr("rooflm.llm.LLM.__init__", refuse)
    monkeypatch.setattr("rooflm.bench.latency.measure_ceilings", lambda device, dtype: dict(CPU_CEILINGS))


def _free(monkeypatch, nbytes: int) -> None:
    monkeypatch.setattr("rooflm.bench.preflight.available_memory", lambda device_type: nbytes)


def test_estimate_is_the_roofline_of_the_weights():
    cfg = load_model_config("llama-2-7b")
    est = preflight.estimate(cfg, CPU_CEILINGS, "32", 1, 128, 32, 2, kv_bytes=GiB)
    params = 6.74e9  # Llama-2-7B (the analyzer keeps the embedding table in 16 bits: 2% less)
    assert est.weights_bytes == pytest.approx(4 * params, rel=0.03)  # float32
    assert est.tpot_s == pytest.approx(est.weights_bytes / 10e9, rel=0.05)  # memory-bound decode at 10 GB/s
    assert est.run_s > 2 * 31 * est.tpot_s and est.memory_bytes == est.weights_bytes + GiB
    half = preflight.estimate(cfg, CPU_CEILINGS, "16", 1, 128, 32, 2, kv_bytes=GiB)
    assert half.weights_bytes == pytest.approx(2 * params, rel=0.01)


@pytest.mark.parametrize("dtype, quantization, bits", [("float32", None, "32"), ("bfloat16", None, "bf16"),
                                                      ("float16", None, "16"), ("float32", "w4a16", "4"),
                                                      ("float16", "fp8", "fp8")])
def test_weight_bits(dtype, quantization, bits):
    assert preflight.weight_bits(dtype, quantization) == bits


@pytest.mark.parametrize("command", ["latency", "throughput"])
def test_a_model_larger_than_the_free_memory_is_refused(command, monkeypatch, capsys, no_loading):
    _free(monkeypatch, 8 * GiB)
    argv = ["bench", command, "--model", "llama-2-7b", "--load-format", "dummy", "--device", "cpu", "--dtype",
            "float32", "--input-len", "16", "--output-len", "4", "--yes"]
    if command == "throughput":
        argv += ["--num-prompts", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "llama-2-7b: weights 2" in err and "the roofline predicts TPOT >=" in err  # said before anything loads
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"rooflm bench {command}: error: --model llama-2-7b: needs about 2") and \
        "GiB (weights 2" in last and "but 8.00 GiB is free" in last


def test_a_long_run_needs_yes(monkeypatch, capsys, no_loading):
    _free(monkeypatch, 1024 * GiB)
    argv = ["bench", "latency", "--model", "llama-2-7b", "--load-format", "dummy", "--device", "cpu", "--dtype",
            "float32", "--input-len", "128", "--output-len", "128"]
    assert main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--model llama-2-7b: the roofline predicts at least" in last and "pass --yes" in last
    # with --yes the check passes and the benchmark goes on to load the model (here: the test's refusal)
    with pytest.raises(AssertionError, match="the model was loaded"):
        main(argv + ["--yes"])


def test_a_small_model_goes_on_without_yes(monkeypatch, no_loading):
    _free(monkeypatch, 16 * GiB)
    with pytest.raises(AssertionError, match="the model was loaded"):
        main(["bench", "latency", "--model", "smollm2-135m", "--load-format", "dummy", "--device", "cpu",
              "--dtype", "float32", "--input-len", "16", "--output-len", "4"])


@pytest.mark.parametrize("command", ["latency", "throughput"])
def test_lengths_beyond_the_models_positions_fail_before_measuring(command, monkeypatch, capsys, no_loading):
    monkeypatch.setattr("rooflm.bench.latency.measure_ceilings", lambda *a: pytest.fail("the ceilings were measured"))
    assert main(["bench", command, "--model", "llama-2-7b", "--load-format", "dummy", "--device", "cpu",
                 "--input-len", "4000", "--output-len", "200"]) == 2
    assert capsys.readouterr().err.strip() == (f"rooflm bench {command}: error: --input-len 4000 + --output-len 200: "
                                               "must be <= 4096, the max positions of llama-2-7b")


def test_the_benchmark_kv_pool_is_sized_in_the_cache_dtype():
    """A quantized cache stores a token in about half the bytes: the pool a benchmark asks for (and the preflight
    counts) follows, instead of holding twice the tokens it needs."""
    import argparse

    import torch

    from rooflm.bench.latency import kv_cache_bytes

    sizes = {kv: kv_cache_bytes(argparse.Namespace(kv_cache_memory_gib=None, model="llama-2-7b", kv_cache_dtype=kv),
                                torch.float16, 16 * 4096) for kv in ("auto", "int8", "fp8")}
    assert sizes["int8"] == sizes["fp8"]
    # int8 values (1 byte) plus one float32 scale per token and head of 128: (128 + 4) / 256 of the fp16 bytes
    assert sizes["int8"] / sizes["auto"] == pytest.approx((128 + 4) / 256, rel=1e-6)


def test_a_model_split_over_gpus_needs_only_its_share_on_each(monkeypatch):
    """Mixtral-8x7B in float16 (about 87 GiB) does not fit one 80 GiB GPU, but its half does at -tp 2; on the CPU
    the ranks share the host's memory, each with its own KV pool."""
    import argparse

    import torch

    from rooflm.bench.latency import preflight as bench_preflight

    _free(monkeypatch, 80 * GiB)
    args = argparse.Namespace(model="mixtral-8x7b", dtype="float16", quantization=None, input_len=512,
                              output_len=64, yes=True, tensor_parallel_size=1, pipeline_parallel_size=1)
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match="--model mixtral-8x7b: needs about"):
        bench_preflight(args, cuda, CPU_CEILINGS, 1, GiB, 1)
    args.tensor_parallel_size = 2
    bench_preflight(args, cuda, CPU_CEILINGS, 1, GiB, 1)
    with pytest.raises(ValueError, match="--model mixtral-8x7b: needs about"):
        bench_preflight(args, torch.device("cpu"), CPU_CEILINGS, 1, GiB, 1)
