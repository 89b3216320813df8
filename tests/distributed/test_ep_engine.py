"""Mixtral over two CPU processes (gloo), with and without expert parallelism: the same tokens and logprobs as one
process.

The tiny Mixtral has 4 experts, top-2 routing and 2 layers. With ``enable_expert_parallel`` rank 0 holds experts 0-1
whole and rank 1 experts 2-3; without it each rank holds half of every expert's intermediate columns."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rooflm.sampling_params import SamplingParams
from test_tp_engine import PROMPTS, _assert_same
from tp_helpers import run

TINY_MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 131,
                "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
                "num_local_experts": 4, "num_experts_per_tok": 2}


def _write_checkpoint(folder, config: dict, seed: int) -> str:
    """Random weights under Hugging Face names (``model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight``...)."""
    from safetensors.torch import save_file

    from rooflm.loader import load_model

    (folder / "config.json").write_text(json.dumps(config))
    model, _ = load_model(str(folder), load_format="dummy", seed=seed, show_progress=False)
    tensors = {name: target.view().clone().contiguous() for name, target in model.weight_targets().items()}
    save_file(tensors, str(folder / "model.safetensors"))
    return str(folder)


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory) -> str:
    return _write_checkpoint(tmp_path_factory.mktemp("tiny-mixtral"), TINY_MIXTRAL, seed=5)


def test_mixtral_expert_parallel_and_tensor_parallel_equal_one_process(make_engine, tiny_mixtral, caplog):
    greedy = SamplingParams(max_tokens=8, temperature=0, logprobs=3, prompt_logprobs=2)
    ref = run(make_engine(model=tiny_mixtral), PROMPTS, greedy)

    caplog.set_level("WARNING", logger="rooflm.models.weights")
    ep = make_engine(model=tiny_mixtral, tensor_parallel_size=2, enable_expert_parallel=True)
    # rank 0 skipped experts 2 and 3 as the loader streamed them, instead of reading them and finding no place
    assert not [r for r in caplog.records if "ignoring checkpoint tensor" in r.getMessage()]
    assert ep.model.model.other_stage_weight("model.layers.0.block_sparse_moe.experts.2.w1.weight")
    assert not ep.model.model.other_stage_weight("model.layers.0.block_sparse_moe.experts.1.w1.weight")
    moe = ep.model.model.layers[1].mlp
    # rank 0: experts 0 and 1 whole (all 96 intermediate columns), the router over all 4
    assert (moe.expert_start, tuple(moe.w13.shape), tuple(moe.w2.shape)) == (0, (2, 192, 64), (2, 64, 96))
    assert moe.gate.out_features == 4
    _assert_same(ref, run(ep, PROMPTS, greedy), tol=1e-5)
    ep.shutdown()  # one process group per process: the next engine makes its own

    tp = make_engine(model=tiny_mixtral, tensor_parallel_size=2)
    moe = tp.model.model.layers[1].mlp
    # rank 0: every expert, intermediate columns 0..47
    assert (tuple(moe.w13.shape), tuple(moe.w2.shape)) == ((4, 96, 64), (4, 64, 48))
    _assert_same(ref, run(tp, PROMPTS, greedy), tol=1e-5)


def _write_gguf(checkpoint: str, path: str) -> None:
    """The checkpoint as llama.cpp's converter writes a Mixtral: architecture ``llama`` with ``expert_count``, q/k
    rows in interleaved-pair order, each layer's experts stacked into ``ffn_{gate,up,down}_exps`` [E, out, in]."""
    from gguf import GGUFWriter
    from safetensors.torch import load_file

    c = TINY_MIXTRAL
    t = {k: v.numpy() for k, v in load_file(f"{checkpoint}/model.safetensors").items()}

    def interleave(w, heads: int):  # HF's rotate-half rows -> llama.cpp's pairs, per head
        return w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)

    w = GGUFWriter(path, "llama")
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(c["vocab_size"])
    w.add_expert_count(c["num_local_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_tensor("token_embd.weight", t["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", t["model.norm.weight"])
    w.add_tensor("output.weight", t["lm_head.weight"])
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        moe = f"{p}.block_sparse_moe"
        named = {"attn_norm": t[f"{p}.input_layernorm.weight"], "ffn_norm": t[f"{p}.post_attention_layernorm.weight"],
                 "attn_q": interleave(t[f"{p}.self_attn.q_proj.weight"], c["num_attention_heads"]),
                 "attn_k": interleave(t[f"{p}.self_attn.k_proj.weight"], c["num_key_value_heads"]),
                 "attn_v": t[f"{p}.self_attn.v_proj.weight"], "attn_output": t[f"{p}.self_attn.o_proj.weight"],
                 "ffn_gate_inp": t[f"{moe}.gate.weight"]}
        for gname, hf in (("ffn_gate_exps", "w1"), ("ffn_down_exps", "w2"), ("ffn_up_exps", "w3")):
            named[gname] = np.stack([t[f"{moe}.experts.{e}.{hf}.weight"] for e in range(c["num_local_experts"])])
        for gname, a in named.items():
            w.add_tensor(f"blk.{i}.{gname}.weight", np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_mixtral_gguf_expert_parallel_equals_one_process(make_engine, tiny_mixtral, tmp_path):
    path = str(tmp_path / "tiny-mixtral.gguf")
    _write_gguf(tiny_mixtral, path)
    greedy = SamplingParams(max_tokens=8, temperature=0, logprobs=3)
    ref = run(make_engine(model=tiny_mixtral), PROMPTS[:3], greedy)
    # the file has no vocabulary: the folder beside it gives none either (token ids only)
    ep = make_engine(model=path, tokenizer=tiny_mixtral, tensor_parallel_size=2, enable_expert_parallel=True)
    assert tuple(ep.model.model.layers[0].mlp.w13.shape) == (2, 192, 64)
    _assert_same(ref, run(ep, PROMPTS[:3], greedy), tol=1e-5)


def test_experts_that_do_not_split_evenly_are_refused_before_any_worker_starts(make_engine, tmp_path):
    three = _write_checkpoint(tmp_path, {**TINY_MIXTRAL, "num_local_experts": 3}, seed=1)
    with pytest.raises(ValueError, match=r"enable_expert_parallel=True with tensor_parallel_size=2 .*"
                                         r"num_local_experts=3"):
        make_engine(model=three, tensor_parallel_size=2, enable_expert_parallel=True)


def test_moe_forward_adds_only_the_experts_a_rank_holds():
    """Two halves of the experts, each computing its own contributions, sum to the whole layer."""
    from rooflm.layers.activation import get_gated_activation
    from rooflm.models.mixtral import moe_forward, route_topk

    g = torch.Generator().manual_seed(0)
    x, w13, w2 = torch.randn(7, 8, generator=g), torch.randn(4, 12, 8, generator=g), torch.randn(4, 8, 6, generator=g)
    weights, ids = route_topk(torch.randn(7, 4, generator=g), 2)
    act = get_gated_activation("silu")
    whole = moe_forward(x, w13, w2, weights, ids, act)
    halves = [moe_forward(x, w13[s:s + 2], w2[s:s + 2], weights, ids, act, expert_start=s) for s in (0, 2)]
    assert all(h.abs().sum() > 0 for h in halves)
    torch.testing.assert_close(halves[0] + halves[1], whole)
    assert not torch.allclose(halves[0], whole)


def test_the_loader_never_reads_another_ranks_tensors(tiny_mixtral):
    from rooflm.loader.safetensors import iter_safetensors, safetensors_files

    files = safetensors_files(tiny_mixtral)
    every = [name for name, _ in iter_safetensors(files)]
    kept = [name for name, _ in iter_safetensors(files, skip=lambda n: ".experts.3." in n)]
    assert sorted(set(every) - set(kept)) == sorted(n for n in every if ".experts.3." in n)
    assert len(every) - len(kept) == 2 * 3  # w1, w2, w3 of expert 3 in each of the 2 layers


def test_the_flag_reaches_the_engine_config_and_bench_latency():
    import argparse

    from rooflm.bench.latency import add_arguments
    from rooflm.entrypoints.args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["-tp", "2", "--enable-expert-parallel", "--threads", "1"]))
    assert (config.tensor_parallel_size, config.enable_expert_parallel) == (2, True)
    assert not engine_config_from_args(parser.parse_args(["--threads", "1"])).enable_expert_parallel
    bench = argparse.ArgumentParser()
    add_arguments(bench)
    assert bench.parse_args(["-tp", "2", "--enable-expert-parallel"]).enable_expert_parallel
    assert not bench.parse_args([]).enable_expert_parallel


def test_a_flag_that_is_not_a_bool_is_a_value_error_naming_it():
    from rooflm.config import EngineConfig

    with pytest.raises(ValueError, match="EngineConfig.enable_expert_parallel='yes'"):
        EngineConfig(enable_expert_parallel="yes")
