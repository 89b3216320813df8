"""StreamingLLM KV compression (Xiao et al. 2023), block-granular: sink blocks plus the most recent window.

A budget that holds the whole sequence changes nothing; a small budget lets a request generate far past the pool
while holding a constant number of blocks; per-request compression leaves its neighbours' tokens untouched."""
from __future__ import annotations

import pytest

from rooflm.kv_cache.compression import KVCompressionConfig, plan_drop
from rooflm.sampling_params import SamplingParams

from engine_utils import run, tokens

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def test_budget_covering_the_sequence_equals_no_compression(make_engine, mixed_prompts):
    prompts = [mixed_prompts[i] for i in (0, 4, 5, 19)]
    plain = tokens(run(make_engine(max_num_batched_tokens=64), prompts, GREEDY))
    longest = max(map(len, prompts)) + GREEDY.max_tokens
    comp = make_engine(max_num_batched_tokens=64,
                       kv_compression={"method": "streaming", "budget": longest + 16, "sink": 4})
    assert tokens(run(comp, prompts, GREEDY)) == plain
    assert comp.kv.prefix_hits == 0  # compressed requests take no prefix hits


def test_generation_past_the_pool_holds_constant_blocks(make_engine, austen_ids):
    bs, budget_blocks = 4, 6
    engine = make_engine(num_gpu_blocks_override=8, block_size=bs, max_num_batched_tokens=64,
                         kv_compression={"method": "streaming", "budget": budget_blocks * bs, "sink": 4})
    pool_tokens = engine.kv.num_blocks * bs
    params = SamplingParams(temperature=0, max_tokens=4 * pool_tokens, ignore_eos=True)
    engine.add_request("r", austen_ids[:50], params)  # longer than the budget: the prompt itself is compressed
    used, out = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        used.append(engine.kv.num_blocks - engine.kv.num_free_blocks)
    assert len(out.outputs[0].token_ids) == 4 * pool_tokens
    assert max(used) == budget_blocks
    first_full = used.index(budget_blocks)
    assert set(used[first_full:-1]) == {budget_blocks}, "the number of blocks held changed once the budget was full"
    assert engine.scheduler.requests == {}


def test_per_request_compression_leaves_the_others_alone(make_engine, austen_ids, mixed_prompts):
    long_prompt = austen_ids[:130]
    plain = make_engine()
    want_other = tokens(run(plain, [mixed_prompts[3]], GREEDY))[0]
    comp_cfg = {"method": "streaming", "budget": 64, "sink": 4}
    engine_wide = make_engine(kv_compression=comp_cfg)
    want_comp = tokens(run(engine_wide, [long_prompt], GREEDY))[0]
    mixed = make_engine()
    got = tokens(run(mixed, [long_prompt, mixed_prompts[3]],
                     [GREEDY.clone(kv_compression=comp_cfg), GREEDY]))
    assert got == [want_comp, want_other]
    # the compressed request dropped blocks: its answer is not the uncompressed one's
    assert want_comp != tokens(run(plain, [long_prompt], GREEDY))[0]


def test_plan_drop_and_validation():
    cfg = KVCompressionConfig(budget=64, sink=4)  # 4 blocks of 16: 1 sink block, room for 32 new tokens a step
    assert cfg.max_new_tokens(16) == 32
    assert plan_drop(cfg, 40, 8, 16) == 0
    assert plan_drop(cfg, 64, 1, 16) == 1
    assert plan_drop(cfg, 63, 32, 16) == 2
    with pytest.raises(ValueError, match="cannot fit"):
        plan_drop(cfg, 20, 60, 16)
    with pytest.raises(ValueError, match="budget"):
        KVCompressionConfig(budget=40, sink=4).check(16)
    with pytest.raises(ValueError, match="method"):
        KVCompressionConfig(method="h3")
    with pytest.raises(ValueError, match="unknown field"):
        KVCompressionConfig.parse('{"budget": 64, "window": 3}')
    with pytest.raises(ValueError, match="kv_compression"):
        SamplingParams(kv_compression={"budget": 0})
