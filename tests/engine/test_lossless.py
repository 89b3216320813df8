"""Continuous batching, chunked prefill, prefix caching, preemption and n > 1 fan-out are lossless: greedy tokens
equal those of each prompt run alone, with none of them. Every test runs in both the synchronous and the
asynchronous scheduling mode (step N+1 scheduled before step N's tokens are read back): the same tokens either way."""
from __future__ import annotations

import pytest

from rooflm.sampling_params import SamplingParams

from engine_utils import run, tokens

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def mode(request) -> bool:
    return request.param


@pytest.fixture(scope="module")
def alone(smol, mixed_prompts):
    """The plain path: each prompt alone, whole prompt in one step, no prefix cache."""
    from rooflm.config import EngineConfig
    from rooflm.engine.engine import LLMEngine

    model, cfg, tok = smol
    engine = LLMEngine(EngineConfig(kv_cache_memory=16 * 2**20, enable_prefix_caching=False, show_progress=False),
                       model=model, model_config=cfg, tokenizer=tok)
    return [tokens(run(engine, [p], GREEDY))[0] for p in mixed_prompts]


def test_batched_equals_alone(make_engine, mixed_prompts, alone, mode):
    engine = make_engine(enable_prefix_caching=False, kv_cache_memory=160 * 2**20, async_scheduling=mode)
    assert tokens(run(engine, mixed_prompts, GREEDY)) == alone
    assert engine.get_stats().num_preemptions == 0
    assert engine.get_stats().num_steps < 2 * GREEDY.max_tokens, "the 32 prompts were not batched together"


@pytest.mark.parametrize("budget", [1, 7, 64])
def test_chunked_prefill_equals_alone(make_engine, mixed_prompts, alone, budget, mode):
    engine = make_engine(enable_prefix_caching=False, max_num_batched_tokens=budget, async_scheduling=mode)
    subset = [0, 1, 5, 10, 19, 30] if budget > 1 else [0, 5, 19]  # budget 1 takes one token a step: keep it short
    got = tokens(run(engine, [mixed_prompts[i] for i in subset], GREEDY))
    assert got == [alone[i] for i in subset]
    longest = max(len(mixed_prompts[i]) for i in subset)
    assert longest > budget, "no prompt was long enough to be chunked"


def test_prefix_caching_equals_alone_and_hits(make_engine, mixed_prompts, alone, mode):
    engine = make_engine(enable_prefix_caching=True, async_scheduling=mode)
    assert tokens(run(engine, mixed_prompts, GREEDY)) == alone
    first_hits = engine.kv.prefix_hits
    # The same prompts again: every full prompt block is now cached.
    assert tokens(run(engine, mixed_prompts, GREEDY)) == alone
    assert engine.kv.prefix_hits > first_hits > 0
    out = run(engine, [mixed_prompts[0]], GREEDY)[0]
    assert out.num_cached_tokens >= 32


def test_prefix_caching_off_never_hits(make_engine, mixed_prompts, alone, mode):
    engine = make_engine(enable_prefix_caching=False, async_scheduling=mode)
    assert tokens(run(engine, mixed_prompts[:8], GREEDY)) == alone[:8]
    assert tokens(run(engine, mixed_prompts[:8], GREEDY)) == alone[:8]
    assert engine.kv.prefix_hits == 0


def test_preemption_is_lossless(make_engine, mixed_prompts, alone, mode):
    # 24 blocks of 16 tokens: far less than 32 prompts of up to ~130 tokens need together.
    engine = make_engine(num_gpu_blocks_override=24, max_model_len=256, enable_prefix_caching=True,
                         async_scheduling=mode)
    assert tokens(run(engine, mixed_prompts, GREEDY)) == alone
    assert engine.get_stats().num_preemptions > 0, "the tiny pool forced no preemption"


def test_n_samples_fan_out_and_share_the_prompt(make_engine, mixed_prompts, alone, mode):
    """n = 3 greedy samples become 3 child requests at the front door; each equals the single greedy answer. With a
    step budget of one prompt, child 0 computes the prompt alone and the others find its full blocks in the prefix
    cache."""
    prompt = mixed_prompts[5]
    engine = make_engine(enable_prefix_caching=True, max_num_batched_tokens=len(prompt), async_scheduling=mode)
    full_blocks = len(prompt) // engine.kv.block_size
    assert full_blocks >= 2
    out = run(engine, [prompt], GREEDY.clone(n=3))[0]
    assert [c.token_ids for c in out.outputs] == [alone[5]] * 3
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert engine.kv.prefix_hits >= 2 * full_blocks * engine.kv.block_size, "children recomputed the prompt"
    # Prompt tokens computed: child 0's whole prompt, then only the partial last block for each other child.
    assert engine.get_stats().prompt_tokens_total == len(prompt) + 2 * (len(prompt) - full_blocks * engine.kv.block_size)
