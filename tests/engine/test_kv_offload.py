"""The prefix cache's host tier (kv_offload_gb): cached blocks evicted from a device pool too small to keep them are
restored from host memory on a later prefix hit. Greedy tokens equal recompute's and a big pool's, the host tier's
counters show the restored prefixes (and prefill computed fewer tokens), and no device or host block leaks."""
from __future__ import annotations

import math

import pytest

from rooflm.config import EngineConfig
from rooflm.kv_cache.host_tier import HostPrefixTier
from rooflm.sampling_params import SamplingParams

from engine_utils import run, tokens

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BS = 16


@pytest.fixture(scope="module")
def shared_prompts(austen_ids) -> list[list[int]]:
    """Four 64-token documents, each asked about twice with different tails: doc0-a, doc1-a, ..., doc0-b, doc1-b, ...
    Run one at a time, every document's second question comes after three other documents went through the pool."""
    docs = [austen_ids[i * 100: i * 100 + 4 * BS] for i in range(4)]
    tails = [austen_ids[600 + j * 13: 600 + j * 13 + 5 + j] for j in range(8)]
    return [docs[i] + tails[r * 4 + i] for r in range(2) for i in range(4)]


@pytest.fixture(scope="module")
def big_pool_tokens(smol, shared_prompts):
    from rooflm.engine.engine import LLMEngine

    model, cfg, tok = smol
    engine = LLMEngine(EngineConfig(kv_cache_memory=16 * 2**20, max_num_seqs=1, show_progress=False), model=model,
                       model_config=cfg, tokenizer=tok)
    return tokens(run(engine, shared_prompts, GREEDY))


def _tiny(make_engine, gb: float, **kw):
    # 8 blocks of 16 tokens: one request (64 + up to 12 prompt tokens, 8 generated) takes 6 of them, so the next
    # document evicts the previous one's prefix from the device
    return make_engine(num_gpu_blocks_override=8, max_model_len=128, max_num_seqs=1, kv_offload_gb=gb, **kw)


def _check_host_clean(engine) -> None:
    tier = engine.scheduler.host_tier
    assert tier.num_free_host_blocks + tier.num_cached_blocks == tier.num_host_blocks, "host blocks leaked"
    assert not tier._busy and not tier._held and not tier._out and not tier._in
    assert engine.runner.kv_offload.num_blocks_in == tier.stats.blocks_restored
    assert engine.runner.kv_offload.num_blocks_out == tier.stats.blocks_offloaded


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_host_tier_equals_recompute_and_big_pool(make_engine, shared_prompts, big_pool_tokens, async_scheduling):
    rec = _tiny(make_engine, 0, async_scheduling=async_scheduling)
    assert tokens(run(rec, shared_prompts, GREEDY)) == big_pool_tokens
    assert rec.get_stats().prefix_hits == 0, "the tiny pool kept a prefix: the test would not exercise the tier"
    off = _tiny(make_engine, 0.05, async_scheduling=async_scheduling)
    assert tokens(run(off, shared_prompts, GREEDY)) == big_pool_tokens
    s, tier = off.get_stats(), off.scheduler.host_tier
    # each document's second question restores its 4 prefix blocks from host memory
    assert s.host_cache_hits == 4 * 4 * BS
    assert s.host_cache_bytes_restored == 16 * tier.bytes_per_block
    assert s.host_cache_bytes_offloaded == tier.stats.blocks_offloaded * tier.bytes_per_block > 0
    assert s.prompt_tokens_total == rec.get_stats().prompt_tokens_total - s.host_cache_hits
    outs = run(off, shared_prompts[4:5], GREEDY)  # doc0 again: on the host (or the device) by now
    assert outs[0].num_cached_tokens == 4 * BS
    _check_host_clean(off)


def test_host_lru_keeps_the_recent_prefixes(make_engine, shared_prompts, big_pool_tokens):
    """A host tier of 6 blocks cannot hold four documents: the oldest are dropped (least recently used), the output
    is still exact and the hits come only from what the host kept."""
    probe = _tiny(make_engine, 1)
    per_block = probe.scheduler.host_tier.bytes_per_block
    engine = _tiny(make_engine, 6 * per_block / 2**30)
    tier = engine.scheduler.host_tier
    assert tier.num_host_blocks == 6
    assert tokens(run(engine, shared_prompts, GREEDY)) == big_pool_tokens
    assert tier.stats.evictions > 0
    assert 0 < engine.get_stats().host_cache_hits < 4 * 4 * BS
    assert engine.get_stats().host_cache_misses > 0
    _check_host_clean(engine)


def test_zero_disables_the_host_tier(make_engine):
    engine = _tiny(make_engine, 0)
    assert engine.scheduler.host_tier is None and engine.runner.kv_offload is None
    assert engine.kv.block_pool.on_evict is None
    assert not engine.get_stats().host_cache_enabled


@pytest.mark.parametrize("value", [-1, math.nan, math.inf, "2", True])
def test_bad_values_name_the_field(value):
    with pytest.raises(ValueError, match="kv_offload_gb"):
        EngineConfig(kv_offload_gb=value)


def test_needs_prefix_caching():
    with pytest.raises(ValueError, match="kv_offload_gb=1"):
        EngineConfig(kv_offload_gb=1, enable_prefix_caching=False)


def test_too_small_to_hold_a_block(make_engine):
    with pytest.raises(ValueError, match="kv_offload_gb"):
        _tiny(make_engine, 1e-9)


# -- the pure-Python bookkeeping -------------------------------------------------------------------------------------

def test_tier_lru_order_and_refresh():
    tier = HostPrefixTier(2, BS, bytes_per_block=10)
    tier.offload(0, 100)
    tier.offload(1, 101)
    out, _ = tier.take()
    assert [d for d, _ in out] == [0, 1]
    tier.offload(5, 100)  # already on the host: refreshed, no copy
    tier.offload(2, 102)  # evicts 101, the least recently used
    out, _ = tier.take()
    assert 100 in tier and 102 in tier and 101 not in tier
    assert len(out) == 1 and out[0][0] == 2
    assert tier.stats.evictions == 1 and tier.stats.bytes_offloaded == 30


def test_tier_never_reuses_a_busy_or_held_host_block():
    tier = HostPrefixTier(2, BS)
    tier.offload(0, 100)
    tier.offload(1, 101)
    tier.take()
    held = tier.hold([100, 101, 102], 0, 3)
    assert held == [100, 101]  # up to the first miss
    tier.offload(7, 103)  # every host block is held: dropped, nothing overwritten
    assert 103 not in tier and tier.take() == ([], [])
    tier.restore(held[:1], [4])
    tier.release(held[1:])
    tier.offload(8, 104)  # 100 is busy (its restore is pending), 101 is free to go
    out, inn = tier.take()
    assert 101 not in tier and 100 in tier and 104 in tier
    assert out == [(8, 1)] and inn == [(0, 4)]  # 100 went to host block 0, 101 to 1
    assert tier.stats.hit_tokens == BS


def test_tier_reset_frees_everything_after_the_pending_step():
    tier = HostPrefixTier(3, BS)
    tier.offload(0, 100)
    tier.offload(1, 101)
    tier.take()
    tier.offload(2, 102)  # pending
    tier.reset()
    assert tier.num_cached_blocks == 0 and tier.num_free_host_blocks == 2
    tier.take()
    assert tier.num_free_host_blocks == 3


def test_evicted_prefix_goes_to_the_host_and_reset_forgets_both_tiers():
    from rooflm.kv_cache import KVCacheManager

    kv = KVCacheManager(2, BS)
    tier = HostPrefixTier(4, BS)
    kv.block_pool.on_evict, kv.host_tier = tier.offload, tier
    prompt = list(range(2 * BS + 1))
    assert not kv.allocate_slots("a", 0, len(prompt))  # 3 blocks do not fit 2
    assert kv.allocate_slots("a", 0, 2 * BS)
    kv.cache_full_blocks("a", prompt, 2 * BS)
    kv.free("a")
    assert kv.allocate_slots("b", 0, BS)  # evicts the least recently freed cached block: a's second
    out, _ = tier.take()
    assert [d for d, _ in out] == [1] and tier.num_cached_blocks == 1
    kv.reset_prefix_cache()
    assert tier.num_cached_blocks == 0 and kv.block_pool.num_cached_blocks == 0
