"""Which models the decode CUDA graphs may capture (rooflm/worker/cuda_graphs.py). A model whose step waits on the
host (Mixtral's reference expert loop asks the GPU which experts were chosen) is never captured: a failed capture
under tensor parallelism leaves PyTorch's allocator and random-number state broken on every rank. Mixtral on the
fused MoE kernels never waits, so it is captured. The check comes before anything touches a GPU, so it runs here with
a stand-in runner on a nominal CUDA device."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from rooflm.models.llama import LlamaForCausalLM
from rooflm.models.mixtral import MixtralForCausalLM
from rooflm.worker.cuda_graphs import capture_decode_graphs


def _tiny_mixtral(ops: str) -> MixtralForCausalLM:
    from rooflm.config import ModelConfig, load_model_config
    from rooflm.layers.custom_op import op_selection

    base = load_model_config("mixtral-8x7b").hf_config
    cfg = ModelConfig.from_hf_dict({**base, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
                                    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96,
                                    "num_local_experts": 4, "num_experts_per_tok": 2})
    with op_selection("cpu", ops=ops):
        return MixtralForCausalLM(cfg)


def test_models_declare_whether_a_step_can_be_captured(monkeypatch) -> None:
    from rooflm.layers.custom_op import select_ops

    assert LlamaForCausalLM.cuda_graph_capturable is True
    model = _tiny_mixtral("native")
    assert model.cuda_graph_capturable is False  # the reference expert loop
    select_ops(model, "triton")
    assert model.cuda_graph_capturable is True  # the fused MoE kernels
    monkeypatch.setenv("ROOFLM_FUSED_MOE", "0")  # the reference loop kept on the GPU path, for comparisons
    assert _tiny_mixtral("triton").cuda_graph_capturable is False


def test_a_model_that_waits_on_the_host_is_not_captured(caplog) -> None:
    runner = SimpleNamespace(device=torch.device("cuda", 0), model=_tiny_mixtral("native"))
    with caplog.at_level(logging.INFO, logger="rooflm"):
        assert capture_decode_graphs(runner, max_num_seqs=4) is None
    assert "MixtralForCausalLM synchronizes with the host" in caplog.text


def _meta(num_new: list[int]):
    from rooflm.attention.metadata_utils import build_attention_metadata

    tables = [[i * 4 + j for j in range(4)] for i in range(len(num_new))]
    return build_attention_metadata(tables, [7] * len(num_new), num_new, 16)[0]


def test_a_step_has_a_graph_shape_only_when_every_request_scores_the_same_tokens() -> None:
    from rooflm.worker.cuda_graphs import uniform_query_len

    assert uniform_query_len(_meta([1, 1, 1])) == 1  # decode
    assert uniform_query_len(_meta([5, 5])) == 5  # a verify step of four drafts each
    assert uniform_query_len(_meta([5])) == 5
    assert uniform_query_len(_meta([5, 3])) == 0  # one request proposed fewer drafts: eager
    assert uniform_query_len(_meta([1, 5])) == 0
    tree = _meta([3, 3])
    tree.tree_masks = [None, torch.ones(3, 3, dtype=torch.bool).tril()]
    assert uniform_query_len(tree) == 0  # a token tree's mask is its own: eager
    tree.tree_masks = [None, None]
    assert uniform_query_len(tree) == 3


def test_verify_graphs_cover_every_chain_length_at_small_batches() -> None:
    from rooflm.worker.cuda_graphs import VERIFY_MAX_BATCH, batch_buckets, verify_buckets

    sizes = batch_buckets(64)
    got = verify_buckets(sizes, 4)
    assert sorted(got) == [2, 3, 4, 5]
    assert all(v == [b for b in sizes if b <= VERIFY_MAX_BATCH] for v in got.values())
    assert verify_buckets(sizes, 0) == {}
    assert verify_buckets([16, 32], 4) == {}
