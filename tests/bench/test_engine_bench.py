"""`rooflm bench latency` and `rooflm bench throughput` run end to end on the CPU (tiny dummy workload) and write
consistent JSON: the same code paths the GPU figures in docs/benchmarks.md come from."""
from __future__ import annotations

import json

import pytest

from rooflm.cli import main

COMMON = ["--model", "smollm2-135m", "--load-format", "dummy", "--device", "cpu", "--dtype", "float32",
          "--input-len", "16", "--output-len", "4"]


def test_bench_latency_json(tmp_path):
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", *COMMON, "--batch-size", "2", "--num-iters", "1", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert (d["batch_size"], d["input_len"], d["output_len"]) == (2, 16, 4)
    assert 0 < d["ttft_s"] < d["e2e_s"] and d["tpot_s"] > 0
    assert d["decode_tok_s"] == pytest.approx(d["batch_size"] / d["tpot_s"], rel=1e-6)
    assert 0 < d["fraction_of_roofline_tpot"] <= 1 and 0 < d["fraction_of_roofline_ttft"] <= 1
    assert d["ceilings"]["copy_gbps"] > 0 and d["ceilings"]["matmul_tflops"] > 0


def test_bench_throughput_json(tmp_path):
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", *COMMON, "--num-prompts", "4", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["num_prompts"] == 4 and d["elapsed_s"] > 0
    assert d["output_tok_s"] == pytest.approx(4 * 4 / d["elapsed_s"], rel=1e-6)
    assert d["requests_per_s"] == pytest.approx(4 / d["elapsed_s"], rel=1e-6)
