"""Tensor and pipeline parallelism together: 4 CPU processes (gloo), 2 pipeline stages of 2 tensor-parallel ranks,
give what one process gives. Rank r runs stage r // 2 as tensor-parallel rank r % 2; each stage all-reduces in its
own group and sends its activations to the rank of the same tensor-parallel rank in the next stage."""
from __future__ import annotations

import argparse

import pytest

from rooflm.sampling_params import SamplingParams
from test_tp_engine import PROMPTS, _assert_same
from tp_helpers import run


def test_tiny_model_tp2_pp2_equals_one_process(make_engine, tiny_checkpoint):
    greedy = SamplingParams(max_tokens=6, temperature=0, logprobs=2, prompt_logprobs=1)
    prompts = PROMPTS[:3]
    ref = run(make_engine(model=tiny_checkpoint), prompts, greedy)
    both = make_engine(model=tiny_checkpoint, tensor_parallel_size=2, pipeline_parallel_size=2)
    m = both.model
    # rank 0: stage 0 (the embedding's vocabulary rows and layer 0, no LM head), half of the 4 query heads
    assert (m.model.start_layer, m.model.end_layer, m.lm_head) == (0, 1, None)
    assert (m.model.layers[0].self_attn.num_heads, m.model.embed_tokens.num_local) == (2, 66)
    assert len(both.runner.kv_caches) == 1
    _assert_same(ref, run(both, prompts, greedy), tol=1e-5)


def test_the_command_line_takes_both_sizes():
    from rooflm.entrypoints.args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["-tp", "2", "-pp", "2", "--threads", "1"]))
    assert (config.tensor_parallel_size, config.pipeline_parallel_size) == (2, 2)


def test_a_torchrun_world_that_is_not_tp_times_pp_names_both_flags(monkeypatch):
    from rooflm.config import EngineConfig
    from rooflm.distributed.torchrun import TorchrunExecutor

    import torch

    config = EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 x pipeline_parallel_size=2 .*WORLD_SIZE=6"):
        TorchrunExecutor(config, torch.device("cpu"), rank=0, world_size=6, local_rank=0)


def test_the_process_group_refuses_a_pipeline_size_that_does_not_divide_the_world():
    import torch

    from rooflm.distributed.parallel_state import init_distributed

    with pytest.raises(ValueError, match="pp_size=4 is invalid for world_size=6"):
        init_distributed(6, 0, "file:///nonexistent", torch.device("cpu"), pp_size=4)
