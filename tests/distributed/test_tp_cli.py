"""The tensor-parallel flags: ``-tp`` / ``--tensor-parallel-size`` on every engine command and on bench latency."""
from __future__ import annotations

import argparse

import pytest

from rooflm.entrypoints.args import add_engine_args, engine_config_from_args


@pytest.mark.parametrize("argv,field", [(["-tp", "2"], "tensor_parallel_size"),
                                        (["--tensor-parallel-size", "2"], "tensor_parallel_size"),
                                        (["-pp", "2"], "pipeline_parallel_size"),
                                        (["--pipeline-parallel-size", "2"], "pipeline_parallel_size")])
def test_engine_flags_reach_the_config(argv, field):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(argv + ["--threads", "1"]))
    assert getattr(config, field) == 2
    assert engine_config_from_args(parser.parse_args(["--threads", "1"])).tensor_parallel_size == 1


def test_a_bad_size_from_the_command_line_names_the_field():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        engine_config_from_args(parser.parse_args(["-tp", "0", "--threads", "1"]))


def test_bench_latency_takes_the_flag():
    from rooflm.bench.latency import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["-tp", "2"]).tensor_parallel_size == 2
    assert parser.parse_args(["-pp", "2"]).pipeline_parallel_size == 2
    assert parser.parse_args([]).tensor_parallel_size == 1


def test_bench_latency_runs_tensor_parallel_on_the_cpu(tmp_path):
    import json

    from rooflm.cli import main
    from rooflm.distributed.parallel_state import get_state

    out = tmp_path / "latency.json"
    argv = ["bench", "latency", "--model", "smollm2-135m", "--load-format", "dummy", "--device", "cpu", "--dtype",
            "float32", "--input-len", "16", "--output-len", "4", "--num-iters", "1", "-tp", "2", "--json", str(out)]
    assert main(argv) == 0
    d = json.loads(out.read_text())
    assert d["tensor_parallel_size"] == 2 and d["tpot_s"] > 0 and not d["cuda_graphs"]
    assert get_state() is None  # the bench shut its workers down


@pytest.mark.parametrize("kw, field", [
    (dict(tensor_parallel_size=2, data_parallel_size=2), "data_parallel_size"),
    (dict(tensor_parallel_size=2, cpu_offload_gb=1), "cpu_offload_gb"),
    (dict(pipeline_parallel_size=2, speculative_config={"method": "self"}), "speculative_config.method"),
    (dict(tensor_parallel_size=2, preemption_mode="swap"), "preemption_mode"),
    (dict(kv_compression={"method": "streaming", "budget": 256}, speculative_config={"method": "self"}),
     "kv_compression"),
])
def test_combinations_not_supported_with_parallelism_are_refused(kw, field):
    from rooflm.config import EngineConfig

    with pytest.raises(ValueError, match=f"EngineConfig.{field}="):
        EngineConfig(**kw)
