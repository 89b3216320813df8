"""Asynchronous scheduling on the GPU: the engine with CUDA graphs, async on, gives the tokens of the synchronous
mode, greedy and seeded, with a batch whose requests end at different steps. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _run(async_scheduling: bool):
    from rooflm import LLM, SamplingParams

    llm = LLM("smollm2-135m", load_format="dummy", dtype="float32", max_num_seqs=8, kv_cache_memory=256 * 2**20,
              max_model_len=512, enable_prefix_caching=True, async_scheduling=async_scheduling, show_progress=False)
    assert llm.engine.async_scheduling is async_scheduling
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (5, 77, 140, 33)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 17, 24)]
    params.append(SamplingParams(temperature=0.8, top_p=0.9, seed=9, n=2, max_tokens=12, ignore_eos=True,
                                 repetition_penalty=1.2))
    outs = llm.generate(prompts, params, use_tqdm=False)
    replays = llm.engine.runner.graph_runner.replays if llm.engine.runner.graph_runner else 0
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    return [[c.token_ids for c in o.outputs] for o in outs], replays


def test_async_equals_sync_on_the_gpu():
    sync, _ = _run(False)
    got, replays = _run(True)
    assert got == sync
    assert replays > 0, "the decode steps did not use the CUDA graphs"
    assert [len(t) for t in got[3]] == [12, 12]
