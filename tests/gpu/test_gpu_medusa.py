"""Medusa heads on the GPU: greedy tokens with chain and tree proposals equal plain decoding (CUDA graphs on for the
plain decode steps; tree steps run the Triton prefill/extend kernel with the tree masks), no block leaks. Skipped
without CUDA."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _run(spec, **kw):
    from rooflm import LLM, SamplingParams

    llm = LLM("smollm2-135m", load_format="dummy", dtype="float32", max_num_seqs=4, kv_cache_memory=256 * 2**20,
              max_model_len=512, speculative_config=spec, show_progress=False, **kw)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (5, 77, 140)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (9, 17, 24)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    return [o.outputs[0].token_ids for o in outs], llm.engine.get_stats()


def _save_heads(path) -> None:
    from rooflm.config import load_model_config
    from rooflm.spec_decode.medusa import MedusaHeads, model_identity, save_medusa_heads

    cfg = load_model_config("smollm2-135m")
    heads = MedusaHeads(2, cfg.hidden_size)
    with torch.no_grad():
        heads.weight.normal_(0, 0.02)
    save_medusa_heads(heads, path, model_identity(cfg, "smollm2-135m"))


@pytest.mark.parametrize("tree", [None, [[0], [1], [0, 0], [0, 1], [1, 0]]], ids=["chain", "tree"])
def test_medusa_greedy_equals_plain_on_the_gpu(tmp_path, tree):
    _save_heads(tmp_path)
    plain, _ = _run(None)
    got, stats = _run({"method": "medusa", "model": str(tmp_path), "num_speculative_tokens": 2, "tree": tree,
                       "auto_disable": False})
    assert got == plain
    assert stats.spec_verifications > 0


def test_medusa_tree_steps_run_the_tree_masked_triton_kernel(tmp_path, monkeypatch):
    """With attention_backend="triton" the verify steps of a tree reach the Triton kernel with their masks (no
    reference fallback), and greedy tokens still equal plain decoding's."""
    from tree_checks import count_tree_kernel_calls  # tests/kernels, on the path (tests/gpu/conftest.py)

    calls = count_tree_kernel_calls(monkeypatch)
    _save_heads(tmp_path)
    plain, _ = _run(None, attention_backend="triton")
    assert calls["tree"] == 0
    got, stats = _run({"method": "medusa", "model": str(tmp_path), "num_speculative_tokens": 2,
                       "tree": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0]], "auto_disable": False},
                      attention_backend="triton")
    assert got == plain
    assert stats.spec_verifications > 0 and calls["tree"] > 0
