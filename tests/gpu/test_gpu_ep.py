"""Mixtral on the fused MoE kernels (in decode CUDA graphs) against the reference expert loop on one GPU, and over
two GPUs (NCCL), with expert parallelism and with tensor-parallel slices of every expert: the same greedy tokens as
one GPU. The two-GPU cases skip without two CUDA devices.

A small random Mixtral (8 experts, top-2, 2 layers, float32) written once as a safetensors checkpoint that every rank
reads its part of, on the default GPU path (Triton kernels, asynchronous scheduling); logprobs within 1e-3."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")

CONFIG = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 1000, "hidden_size": 256,
          "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
          "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "num_local_experts": 8, "num_experts_per_tok": 2}
_g = torch.Generator().manual_seed(0)
PROMPTS = [torch.randint(0, 1000, (n,), generator=_g).tolist() for n in (5, 9, 17, 33, 64, 3)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    import json

    from safetensors.torch import save_file

    from rooflm.loader import load_model

    folder = tmp_path_factory.mktemp("mixtral-random")
    (folder / "config.json").write_text(json.dumps(CONFIG))
    model, _ = load_model(str(folder), load_format="dummy", seed=3, show_progress=False)
    save_file({name: t.view().clone().contiguous() for name, t in model.weight_targets().items()},
              str(folder / "model.safetensors"))
    return str(folder)


def _generate(checkpoint: str, tp: int, ep: bool, replays: list | None = None
              ) -> list[tuple[list[int], list[dict[int, float]]]]:
    from rooflm import LLM
    from rooflm.sampling_params import SamplingParams

    llm = LLM(checkpoint, dtype="float32", tensor_parallel_size=tp, enable_expert_parallel=ep, show_progress=False,
              kv_cache_memory=256 * 2**20, max_model_len=512, max_num_seqs=8)  # few graphs to capture
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, logprobs=1), use_tqdm=False)
        if replays is not None:
            graphs = llm.engine.runner.graph_runner
            replays.append(graphs.replays if graphs is not None else None)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    finally:
        llm.shutdown()


def test_fused_moe_in_cuda_graphs_gives_the_expert_loops_tokens(checkpoint, monkeypatch):
    replays: list = []
    fused = _generate(checkpoint, 1, False, replays)
    monkeypatch.setenv("ROOFLM_FUSED_MOE", "0")  # the reference loop, which waits on the host: eager decode
    loop = _generate(checkpoint, 1, False, replays)
    assert replays[0] and replays[0] > 0 and replays[1] is None  # graphs replayed with the fused kernels only
    for (ref_ids, ref_lp), (ids, lp) in zip(loop, fused):
        assert ids == ref_ids
        for a, b in zip(ref_lp, lp):
            assert max(abs(a[t] - b[t]) for t in a) <= 1e-3


@two_gpus
@pytest.mark.parametrize("ep", [True, False])
def test_two_gpus_give_the_greedy_tokens_of_one(checkpoint, ep):
    one = _generate(checkpoint, 1, False)
    got = _generate(checkpoint, 2, ep)
    for (ref_ids, ref_lp), (ids, lp) in zip(one, got):
        assert ids == ref_ids
        for a, b in zip(ref_lp, lp):
            assert max(abs(a[t] - b[t]) for t in a) <= 1e-3
