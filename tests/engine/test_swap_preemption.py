"""Swap preemption: a victim's KV goes to host memory and comes back into fresh device blocks, so its context is not
recomputed. Greedy tokens equal recompute mode's and a big pool's; every device and host block is free at the end."""
from __future__ import annotations

import pytest

from rooflm.config import EngineConfig
from rooflm.kv_cache.swap import SwapManager, choose_swap
from rooflm.sampling_params import SamplingParams

from engine_utils import run, tokens

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def long_prompts(austen_ids) -> list[list[int]]:
    return [austen_ids[i * 90: i * 90 + 70 + 9 * i] for i in range(5)]


@pytest.fixture(scope="module")
def big_pool_tokens(smol, long_prompts):
    from rooflm.engine.engine import LLMEngine

    model, cfg, tok = smol
    engine = LLMEngine(EngineConfig(kv_cache_memory=16 * 2**20, show_progress=False), model=model,
                       model_config=cfg, tokenizer=tok)
    return tokens(run(engine, long_prompts, GREEDY))


def _tiny(make_engine, mode: str, **kw):
    # 18 blocks of 16 tokens: the five requests need 5-8 blocks each by the end
    return make_engine(num_gpu_blocks_override=18, max_model_len=256, preemption_mode=mode, swap_space=0.01, **kw)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["nocache", "cache"])
def test_swap_equals_recompute_and_big_pool(make_engine, long_prompts, big_pool_tokens, async_scheduling,
                                            prefix_caching):
    rec = _tiny(make_engine, "recompute", async_scheduling=async_scheduling, enable_prefix_caching=prefix_caching)
    assert tokens(run(rec, long_prompts, GREEDY)) == big_pool_tokens
    assert rec.get_stats().num_preemptions > 0, "the tiny pool forced no preemption"
    swp = _tiny(make_engine, "swap", async_scheduling=async_scheduling, enable_prefix_caching=prefix_caching)
    assert tokens(run(swp, long_prompts, GREEDY)) == big_pool_tokens
    sm = swp.scheduler.swap
    assert sm.stats.swap_outs > 0 and sm.stats.recomputes == 0
    assert sm.stats.blocks_swapped_in == sm.stats.blocks_swapped_out
    assert swp.runner.swap_space.num_blocks_in == sm.stats.blocks_swapped_in
    assert sm.num_free_host_blocks == sm.num_host_blocks and not sm.swapped, "host blocks leaked"
    # a swapped request's context is not computed twice: fewer prompt positions than under recompute
    assert swp.scheduler.num_prompt_tokens_computed <= rec.scheduler.num_prompt_tokens_computed


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full(make_engine, long_prompts, big_pool_tokens):
    engine = _tiny(make_engine, "swap")
    sm = engine.scheduler.swap
    sm._free = sm._free[:3]  # three host blocks: most victims do not fit
    sm.num_host_blocks = 3
    assert tokens(run(engine, long_prompts, GREEDY)) == big_pool_tokens
    assert sm.stats.recomputes > 0
    assert sm.num_free_host_blocks == 3


def test_abort_of_a_swapped_request_frees_its_host_blocks(make_engine, long_prompts):
    engine = _tiny(make_engine, "swap")
    for i, p in enumerate(long_prompts):
        engine.add_request(str(i), p, GREEDY)
    sm = engine.scheduler.swap
    while not sm.swapped:
        engine.step()
    victim = next(iter(sm.swapped))
    engine.abort_request(victim.split("#")[0])
    assert victim not in sm.swapped
    while engine.has_unfinished_requests():
        engine.step()
    assert sm.num_free_host_blocks == sm.num_host_blocks


@pytest.mark.parametrize("recompute_s,expect_swap", [(1.0, True), (1e-9, False)])
def test_auto_follows_the_cost_rule(make_engine, long_prompts, big_pool_tokens, recompute_s, expect_swap):
    engine = _tiny(make_engine, "auto")
    sm = engine.scheduler.swap
    sm.recompute_seconds = lambda n: recompute_s * n  # an injected cost model: deterministic
    assert tokens(run(engine, long_prompts, GREEDY)) == big_pool_tokens
    assert (sm.stats.swap_outs > 0) is expect_swap
    assert (sm.stats.recomputes > 0) is not expect_swap


def test_choose_swap_rule():
    # 1 MiB out and back in at 1 GiB/s takes 2/1024 s
    assert choose_swap(3e-3, 2**20, 2**30)
    assert not choose_swap(1e-3, 2**20, 2**30)


def test_swap_manager_bookkeeping():
    sm = SwapManager(4, "swap")
    assert sm.should_swap(3, 40) and not sm.should_swap(5, 80) and not sm.should_swap(0, 0)
    sm.swap_out("a", [7, 8, 9])
    assert sm.take() == ([(7, 0), (8, 1), (9, 2)], [])
    sm.swap_in("a", [1, 2, 3])
    # released host blocks are not handed out before the step's copies are taken
    assert sm.num_free_host_blocks == 1
    assert sm.take() == ([], [(0, 1), (1, 2), (2, 3)])
    assert sm.num_free_host_blocks == 4
    with pytest.raises(ValueError, match="preemption_mode"):
        SwapManager(4, "never")


def test_config_rejects_bad_preemption_options():
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig(preemption_mode="drop")
    with pytest.raises(ValueError, match="swap_space"):
        EngineConfig(swap_space=-1)
