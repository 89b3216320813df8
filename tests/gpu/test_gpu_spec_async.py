"""Speculative decoding under asynchronous scheduling on the GPU (CUDA graphs on): steps in which speculation is
switched off are pipelined, drafting steps wait for the step in flight, and the greedy tokens equal the synchronous
mode's and plain decoding's, for prompt lookup and for self-speculation, with the switch-off forced above two decoding
requests and on every other 8 tokens of context below, so that it flips during the run. Skipped without CUDA."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))

SPECS = {"ngram": {"method": "ngram", "num_speculative_tokens": 4},
         "self": {"method": "self", "num_draft_layers": 10, "num_speculative_tokens": 3}}


def _prompts(n: int) -> list[list[int]]:
    """Random tokens with a passage repeated at the end (prompt lookup proposes its continuation)."""
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(n):
        passage = torch.randint(0, 49152, (24,), generator=g).tolist()
        filler = torch.randint(0, 49152, (7 + 13 * i,), generator=g).tolist()
        out.append(passage + filler + passage[:10])
    return out


def _run(spec, async_scheduling: bool, force_off_above: int | None = 2, n: int = 6):
    from engine_utils import record_launches

    from rooflm import LLM, SamplingParams

    llm = LLM("smollm2-135m", load_format="dummy", dtype="float32", max_num_seqs=4 if n <= 8 else n + 2,
              kv_cache_memory=(256 if n <= 8 else 1024) * 2**20, max_model_len=512, enable_prefix_caching=True, async_scheduling=async_scheduling,
              speculative_config=spec, show_progress=False)
    engine = llm.engine
    assert engine.async_scheduling is async_scheduling
    if spec is not None and force_off_above is not None:  # off above that batch, and on every other 8 tokens below
        engine.proposer.pays = lambda decodes, *cost: (len(decodes) <= force_off_above
                                                      and sum(r.num_tokens for r in decodes) // 8 % 2 == 0)
    launches = record_launches(engine) if spec is not None else []
    params = [SamplingParams(temperature=0, max_tokens=(5, 9, 14, 20, 26, 32)[i % 6], ignore_eos=True)
              for i in range(n)]
    params += [SamplingParams(temperature=0.8, top_p=0.9, seed=9, n=2, max_tokens=12, ignore_eos=True,
                              repetition_penalty=1.2)]
    outs = llm.generate(_prompts(n + 1), params, use_tqdm=False)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    replays = engine.runner.graph_runner.replays if engine.runner.graph_runner else 0
    return [[c.token_ids for c in o.outputs] for o in outs], engine.get_stats(), launches, replays


@pytest.mark.parametrize("method", ["ngram", "self"])
def test_async_speculation_equals_sync_and_plain_on_the_gpu(method):
    from engine_utils import check_pipelining

    plain, _, _, _ = _run(None, False)
    sync, _, _, _ = _run(SPECS[method], False)
    got, stats, launches, replays = _run(SPECS[method], True)
    assert sync == plain and got == plain
    check_pipelining(launches)
    assert stats.spec_steps_disabled > 0 and stats.spec_verifications > 0
    assert replays > 0, "the pipelined decode steps did not use the CUDA graphs"


def test_the_roofline_rule_at_a_large_batch_on_the_gpu():
    """No injected decision: 32 requests, the live roofline and prompt lookup's hit rate decide; tokens equal the
    synchronous mode's and steps overlapped."""
    sync, _, _, _ = _run(SPECS["ngram"], False, None, n=31)
    got, stats, launches, _ = _run(SPECS["ngram"], True, None, n=31)
    assert got == sync
    assert sum(in_flight for in_flight, _, _ in launches) > 0, "no step was pipelined"
    print(f"steps {len(launches)}, pipelined {sum(i for i, _, _ in launches)}, verify steps "
          f"{sum(s for _, s, _ in launches)}, switched off {stats.spec_steps_disabled}")
