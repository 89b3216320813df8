"""H2O KV compression (Zhang et al. 2023), block-granular: the recent window plus the blocks with the largest
accumulated attention scores.

The choice keeps the highest-scored blocks (synthetic scores); the per-block scores equal the softmax probabilities
computed one query at a time; a budget that holds the whole sequence changes nothing; a request generating past the
pool holds a constant number of blocks; and the engine drops exactly the blocks its accumulated scores rank lowest."""
from __future__ import annotations

import math

import pytest
import torch

from rooflm.config import EngineConfig
from rooflm.kv_cache.compression import KVCompressionConfig, plan_h2o_drop
from rooflm.sampling_params import SamplingParams

from engine_utils import run, tokens

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


# -- the choice ------------------------------------------------------------------------------------------------------

def test_drop_keeps_the_highest_scored_blocks():
    bs = 4
    cfg = KVCompressionConfig(method="h2o", budget=8 * bs, recent=2 * bs)  # 8 blocks, the last 2 full ones protected
    scores = [9.0, 0.5, 7.0, 0.1, 3.0, 0.2, 0.0, 0.0]  # blocks 6 and 7 are recent: never candidates
    # 8 full blocks cached, 5 new tokens: 2 more blocks needed, so 2 dropped: the two lowest candidates
    assert plan_h2o_drop(cfg, 8 * bs, 5, bs, scores) == [3, 5]
    # 3 blocks over: the next lowest joins; ties go to the older block
    assert plan_h2o_drop(cfg, 8 * bs, 2 * bs + 1, bs, scores) == [1, 3, 5]
    assert plan_h2o_drop(cfg, 8 * bs, 2 * bs + 1, bs, [1.0] * 8) == [0, 1, 2]
    assert plan_h2o_drop(cfg, 6 * bs, bs, bs, scores) == []  # within the budget
    with pytest.raises(ValueError, match="cannot fit the budget"):
        plan_h2o_drop(cfg, 8 * bs, 6 * bs + 1, bs, scores)  # 7 over, 6 candidates


def test_config_recent_window_and_validation():
    cfg = KVCompressionConfig.parse({"method": "h2o", "budget": 64})
    assert cfg.protected_blocks(16) == 2  # recent defaults to half the budget
    assert cfg.max_new_tokens(16) == (4 - 2 - 1) * 16
    with pytest.raises(ValueError, match="kv_compression.budget=64"):
        KVCompressionConfig(method="h2o", budget=64, recent=48).check(16)
    with pytest.raises(ValueError, match="kv_compression.recent=-1"):
        KVCompressionConfig(method="h2o", recent=-1)
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(kv_compression={"method": "h2o"}, async_scheduling=True)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_compression={"method": "h2o"}, kv_cache_dtype="int8")


# -- the scores ------------------------------------------------------------------------------------------------------

def test_block_scores_equal_per_query_softmax():
    from rooflm.attention.h2o_scores import BlockScoreCollector

    torch.manual_seed(0)
    bs, heads, kv_heads, d, ctx, n = 4, 4, 2, 8, 11, 3  # 3 new queries at cache indices 8, 9, 10
    cache = torch.randn(2, 6, bs, kv_heads, d)
    table = torch.tensor([[5, 1, 3, 0]])
    q = torch.randn(n, heads, d)
    col = BlockScoreCollector([("r", 0)], bs, table, [0, n], [ctx])
    col.add(q, cache, 0.5)
    keys = cache[0][table[0]].reshape(-1, kv_heads, d)[:ctx]
    want = torch.zeros(ctx)
    for j in range(n):
        for h in range(heads):
            visible = keys[: ctx - n + j + 1, h // (heads // kv_heads)]
            want[: ctx - n + j + 1] += torch.softmax(visible @ q[j, h] * 0.5, dim=0)
    want_blocks = torch.nn.functional.pad(want, (0, 1)).view(3, bs).sum(1)
    got = col.to_lists()["r"]
    assert got == pytest.approx(want_blocks.tolist(), abs=1e-5)
    assert sum(got) == pytest.approx(n * heads, abs=1e-4)  # each query's probabilities sum to one per head


# -- the engine ------------------------------------------------------------------------------------------------------

def test_budget_covering_the_sequence_equals_no_compression(make_engine, mixed_prompts):
    prompts = [mixed_prompts[i] for i in (0, 4, 5, 19)]
    plain = tokens(run(make_engine(max_num_batched_tokens=64), prompts, GREEDY))
    longest = max(map(len, prompts)) + GREEDY.max_tokens
    comp = make_engine(max_num_batched_tokens=64, kv_compression={"method": "h2o", "budget": longest + 16})
    assert tokens(run(comp, prompts, GREEDY)) == plain
    assert comp.scheduler.h2o_scores == {}, "scores of finished requests left behind"


def test_generation_past_the_pool_holds_constant_blocks_and_drops_the_lowest(make_engine, austen_ids):
    bs, budget_blocks = 4, 6
    engine = make_engine(num_gpu_blocks_override=8, block_size=bs, max_num_batched_tokens=64,
                         kv_compression={"method": "h2o", "budget": budget_blocks * bs, "recent": 2 * bs})
    pool_tokens = engine.kv.num_blocks * bs
    params = SamplingParams(temperature=0, max_tokens=4 * pool_tokens, ignore_eos=True)
    engine.add_request("r", austen_ids[:50], params)
    cfg = engine.model_config
    per_query = cfg.num_attention_heads * cfg.num_hidden_layers  # probability mass one query hands out
    used, out, checked = [], None, 0
    drops: list[tuple[int, int]] = []
    drop_blocks = engine.kv.drop_blocks

    def recording_drop(seq_id, start, n):
        drops.append((start, n))
        return drop_blocks(seq_id, start, n)

    engine.kv.drop_blocks = recording_drop
    while engine.has_unfinished_requests():
        rid = next(iter(engine.scheduler.requests))
        req = engine.scheduler.requests[rid]
        before_scores = list(engine.scheduler.h2o_scores.get(rid, []))
        cache_len = req.num_computed_tokens - req.num_dropped_tokens
        for o in engine.step():
            out = o
        used.append(engine.kv.num_blocks - engine.kv.num_free_blocks)
        gone = sorted(start for start, n in drops for _ in range(n))  # one block at a time, last first
        drops.clear()
        if gone:  # the dropped blocks are the lowest-scored full blocks before the 2-block recent window
            candidates = before_scores[: cache_len // bs - 2]
            ranked = sorted(range(len(candidates)), key=lambda i: (candidates[i], i))
            assert gone == sorted(ranked[: len(gone)])
            checked += 1
        if rid in engine.scheduler.h2o_scores:
            total = sum(engine.scheduler.h2o_scores[rid])
            assert 0 < total <= req.num_computed_tokens * per_query * (1 + 1e-4)
    assert len(out.outputs[0].token_ids) == 4 * pool_tokens
    assert max(used) == budget_blocks
    first_full = used.index(budget_blocks)
    assert set(used[first_full:-1]) == {budget_blocks}, "the number of blocks held changed once the budget was full"
    assert checked > 10
    assert not math.isnan(sum(engine.scheduler.h2o_scores.get("r", [0.0])))


def test_per_request_h2o_compresses_and_needs_sync(make_engine, austen_ids):
    long_prompt = austen_ids[:130]
    engine = make_engine()
    plain = tokens(run(engine, [long_prompt], GREEDY))
    h2o = tokens(run(engine, [long_prompt], GREEDY.clone(kv_compression={"method": "h2o", "budget": 64})))
    assert h2o != plain  # 64 of 150 tokens kept
    engine = make_engine(async_scheduling=True)
    with pytest.raises(ValueError, match="h2o"):
        engine.add_request("r", long_prompt, GREEDY.clone(kv_compression={"method": "h2o", "budget": 64}))
