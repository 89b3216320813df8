"""Speculative verify steps replayed from CUDA graphs: at batch 1 every verify step of a chain has the same number of
tokens per request, so the engine replays a captured graph for it. The greedy tokens equal the eager engine's and
plain decoding's, and the verify graphs were really replayed. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _prompt() -> list[int]:
    g = torch.Generator().manual_seed(11)
    passage = torch.randint(0, 49152, (32,), generator=g).tolist()
    return passage + torch.randint(0, 49152, (9,), generator=g).tolist() + passage[:12]


def _run(spec, enforce_eager: bool):
    from rooflm import LLM, SamplingParams

    llm = LLM("smollm2-135m", load_format="dummy", dtype="float32", max_num_seqs=4, kv_cache_memory=256 * 2**20,
              max_model_len=512, speculative_config=spec, enforce_eager=enforce_eager, show_progress=False)
    if spec is not None:  # always draft, whatever the roofline says, so every step after the first verifies
        llm.engine.proposer.pays = lambda decodes, *cost: True
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    out = llm.generate([_prompt()], params, use_tqdm=False)[0].outputs[0].token_ids
    gr = llm.engine.runner.graph_runner
    return out, llm.engine.get_stats(), gr


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 4},
                                  {"method": "self", "num_draft_layers": 10, "num_speculative_tokens": 3}])
def test_verify_graphs_equal_eager_and_plain(spec):
    plain, _, _ = _run(None, True)
    eager, _, none = _run(spec, True)
    got, stats, gr = _run(spec, False)
    assert none is None
    assert eager == plain and got == plain
    k = spec["num_speculative_tokens"]
    assert sorted(gr.verify_sizes) == list(range(2, k + 2)) and all(gr.verify_sizes[q][0] == 1 for q in
                                                                   gr.verify_sizes)
    assert stats.spec_verifications > 0
    assert gr.verify_replays > 0, "no verify step was replayed from a graph"
