"""The offline benchmarks default to the embedded model on a machine without a GPU; options given win."""
from __future__ import annotations

import argparse

import pytest

from rooflm.bench import cli as bench_cli
from rooflm.cli import build_parser
from rooflm.loader.default_model import default_model_path


def _parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


@pytest.mark.parametrize("command", ["latency", "throughput"])
def test_cpu_defaults_are_the_embedded_model(command, monkeypatch):
    args = _parse(["bench", command])
    assert args.model is None and args.dtype is None  # left to the machine, resolved when the command runs
    seen: dict = {}
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    fake = bench_cli._with_machine_defaults(lambda a: seen.update(vars(a)) or 0, {})
    assert fake(args) == 0
    assert seen["model"] == default_model_path() and seen["dtype"] == "float32" and seen["load_format"] == "auto"
    assert seen["input_len"] == 128 and seen["output_len"] == 32


def test_gpu_defaults_and_explicit_options(monkeypatch):
    seen: dict = {}
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    fake = bench_cli._with_machine_defaults(lambda a: seen.update(vars(a)) or 0, {"input_len": 1024})
    assert fake(_parse(["bench", "latency"])) == 0
    assert seen["model"] == "llama-2-7b" and seen["dtype"] == "float16" and seen["input_len"] == 1024
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert fake(_parse(["bench", "latency", "--model", "smollm2-135m", "--dtype", "bfloat16"])) == 0
    assert seen["model"] == "smollm2-135m" and seen["dtype"] == "bfloat16" and seen["load_format"] == "auto"


def test_a_checkpoint_path_loads_its_weights_on_a_gpu_machine(monkeypatch, tmp_path):
    """On a GPU machine the default model is a named shape with random weights; a checkpoint given by path must not
    get random weights too (a benchmark of it would measure a random model, as a speculative-decoding run once did)."""
    seen: dict = {}
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    fake = bench_cli._with_machine_defaults(lambda a: seen.update(vars(a)) or 0, {})
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    assert fake(_parse(["bench", "spec", "--model", str(gguf)])) == 0
    assert seen["model"] == str(gguf) and seen["load_format"] == "auto" and seen["dtype"] == "float16"
    assert fake(_parse(["bench", "spec", "--model", str(gguf), "--load-format", "dummy"])) == 0
    assert seen["load_format"] == "dummy"
    assert fake(_parse(["bench", "latency", "--model", "llama-2-7b"])) == 0  # a named shape: random weights
    assert seen["load_format"] == "dummy"
