"""Which models the decode CUDA graphs may capture (rooflm/worker/cuda_graphs.py). A model whose step waits on the
host (Mixtral's reference expert loop asks the GPU which experts were chosen) is never captured: a failed capture
under tensor parallelism leaves PyTorch's allocator and random-number state broken on every rank. The check comes
before anything touches a GPU, so it runs here with a stand-in runner on a nominal CUDA device."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from rooflm.models.llama import LlamaForCausalLM
from rooflm.models.mixtral import MixtralForCausalLM
from rooflm.worker.cuda_graphs import capture_decode_graphs


def test_models_declare_whether_a_step_can_be_captured() -> None:
    assert LlamaForCausalLM.cuda_graph_capturable is True
    assert MixtralForCausalLM.cuda_graph_capturable is False


def test_a_model_that_waits_on_the_host_is_not_captured(caplog) -> None:
    runner = SimpleNamespace(device=torch.device("cuda", 0), model=MixtralForCausalLM.__new__(MixtralForCausalLM))
    with caplog.at_level(logging.INFO, logger="rooflm"):
        assert capture_decode_graphs(runner, max_num_seqs=4) is None
    assert "MixtralForCausalLM synchronizes with the host" in caplog.text
