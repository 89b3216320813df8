"""BlockPool, FreeBlockQueue and chained block hashes: exact block ids, ref counts, hash hits, LRU eviction order."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rooflm.kv_cache import BlockPool, FreeBlockQueue, KVBlock, hash_block, hash_token_blocks


def queue_ids(pool: BlockPool) -> list[int]:
    return pool.free_block_queue.block_ids()


def check_pool_invariants(pool: BlockPool) -> None:
    ids = queue_ids(pool)
    assert len(ids) == len(set(ids)) == pool.num_free_blocks
    for b in pool.blocks:
        assert b.ref_cnt >= 0
        assert (b.block_id in ids) == (b.ref_cnt == 0), f"block {b.block_id}: in queue iff ref_cnt == 0"
        if b.block_hash is not None:
            assert pool.cached_block_hash_to_block[b.block_hash] is b
    assert all(b.block_hash == h for h, b in pool.cached_block_hash_to_block.items())
    assert pool.usage == pytest.approx(sum(b.ref_cnt > 0 for b in pool.blocks) / pool.num_blocks)


# ---- hashing ---------------------------------------------------------------------------------------------------


def test_hash_is_chained_and_deterministic() -> None:
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    h_a = hash_block(None, a)
    assert h_a == hash_block(None, list(a)) == hash_block(None, tuple(a))
    assert 0 <= h_a < 2**64
    # Same block tokens, different history: different hash.
    assert hash_block(h_a, b) != hash_block(None, b)
    assert hash_block(h_a, b) != hash_block(hash_block(None, [1, 2, 3, 5]), b)
    # Parent None is not parent 0; extra keys salt the hash.
    assert hash_block(None, b) != hash_block(0, b)
    assert hash_block(None, b, ("lora", 1)) != hash_block(None, b)
    assert hash_block(None, b, ("lora", 1)) == hash_block(None, b, ("lora", 1))
    with pytest.raises(TypeError):
        hash_block(None, b, (object(),))


def test_hash_token_blocks_covers_full_blocks_only() -> None:
    toks = list(range(10))
    hs = hash_token_blocks(toks, 4)
    assert len(hs) == 2  # the trailing 2 tokens are not a full block
    assert hs[0] == hash_block(None, [0, 1, 2, 3])
    assert hs[1] == hash_block(hs[0], [4, 5, 6, 7])
    assert hash_token_blocks(toks[:3], 4) == []
    assert hash_token_blocks(toks[:8], 4) == hs


def test_hash_is_stable_across_processes() -> None:
    code = "from rooflm.kv_cache import hash_block; print(hash_block(hash_block(None, [1, 2]), [3, 4], ('x', 7)))"
    outs = set()
    for seed in ("0", "123"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True).stdout.strip())
    assert outs == {str(hash_block(hash_block(None, [1, 2]), [3, 4], ("x", 7)))}


def test_kv_cache_package_does_not_import_torch() -> None:
    code = "import sys, rooflm.kv_cache; assert 'torch' not in sys.modules, 'rooflm.kv_cache imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- free queue ------------------------------------------------------------------------------------------------


def test_free_queue_o1_ops() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.block_ids() == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(blocks[2])  # middle
    q.remove(blocks[0])  # head
    q.remove(blocks[4])  # tail
    assert q.block_ids() == [1, 3] and len(q) == 2
    assert blocks[2] not in q and blocks[1] in q
    q.append(blocks[0])
    assert q.block_ids() == [1, 3, 0]
    assert q.popleft() is blocks[1]
    with pytest.raises(ValueError):
        q.append(blocks[3])  # already queued
    with pytest.raises(ValueError):
        q.remove(blocks[2])  # not queued
    q.popleft(), q.popleft()
    with pytest.raises(ValueError):
        q.popleft()
    assert len(q) == 0 and q.block_ids() == []


# ---- block pool ------------------------------------------------------------------------------------------------


def test_get_new_blocks_pops_ids_in_order() -> None:
    pool = BlockPool(6)
    assert queue_ids(pool) == [0, 1, 2, 3, 4, 5] and pool.num_free_blocks == 6 and pool.usage == 0.0
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [0, 1, 2]
    assert [b.ref_cnt for b in got] == [1, 1, 1]
    assert queue_ids(pool) == [3, 4, 5] and pool.num_free_blocks == 3 and pool.usage == 0.5
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 4]
    assert pool.get_new_blocks(0) == []
    with pytest.raises(ValueError, match="only 1 of 6 are free"):
        pool.get_new_blocks(2)
    assert queue_ids(pool) == [5]  # a refused request takes nothing
    check_pool_invariants(pool)


def test_free_order_becomes_queue_order() -> None:
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(5)
    pool.free_blocks([blocks[3], blocks[1], blocks[4]])
    assert queue_ids(pool) == [5, 6, 7, 3, 1, 4]
    # A block with two holders returns to the queue only when the last one frees it.
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 2
    pool.free_blocks([blocks[0]])
    assert blocks[0].ref_cnt == 1 and queue_ids(pool) == [5, 6, 7, 3, 1, 4]
    pool.free_blocks([blocks[2], blocks[0]])
    assert queue_ids(pool) == [5, 6, 7, 3, 1, 4, 2, 0]
    # The next allocation takes the least recently freed first.
    assert [b.block_id for b in pool.get_new_blocks(4)] == [5, 6, 7, 3]
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([blocks[2]])
    check_pool_invariants(pool)


def test_lru_eviction_of_cached_blocks() -> None:
    pool = BlockPool(4)
    b = pool.get_new_blocks(4)
    h = [hash_block(None, [i]) for i in range(3)]
    for i in range(3):
        assert pool.cache_block(b[i], h[i])
    assert pool.num_cached_blocks == 3
    pool.free_blocks([b[1], b[0], b[2], b[3]])
    assert queue_ids(pool) == [1, 0, 2, 3]
    # Freed cached blocks keep their hashes and can still be hit.
    assert pool.get_cached_block(h[1]) is b[1] and b[1].block_hash == h[1]

    (first,) = pool.get_new_blocks(1)  # evicts the least recently freed cached block: 1
    assert first is b[1] and first.ref_cnt == 1 and first.block_hash is None
    assert pool.get_cached_block(h[1]) is None
    assert pool.get_cached_block(h[0]) is b[0] and pool.get_cached_block(h[2]) is b[2]

    (second,) = pool.get_new_blocks(1)
    assert second is b[0] and pool.get_cached_block(h[0]) is None
    assert set(pool.cached_block_hash_to_block) == {h[2]}
    check_pool_invariants(pool)


def test_touch_revives_cached_free_block() -> None:
    pool = BlockPool(5)
    b = pool.get_new_blocks(3)
    hx = hash_block(None, [42])
    pool.cache_block(b[1], hx)
    pool.free_blocks([b[2], b[1], b[0]])
    assert queue_ids(pool) == [3, 4, 2, 1, 0]
    hit = pool.get_cached_block(hx)
    assert hit is b[1] and hit.ref_cnt == 0  # lookup takes no reference
    pool.touch([hit])
    assert hit.ref_cnt == 1 and queue_ids(pool) == [3, 4, 2, 0] and pool.num_free_blocks == 4
    # The revived block is not handed out by allocations and keeps its hash.
    assert [x.block_id for x in pool.get_new_blocks(4)] == [3, 4, 2, 0]
    assert pool.get_cached_block(hx) is b[1]
    pool.touch([hit])  # a second holder
    assert hit.ref_cnt == 2
    check_pool_invariants(pool)


def test_duplicate_hash_keeps_existing_entry() -> None:
    pool = BlockPool(3)
    b0, b1, _ = pool.get_new_blocks(3)
    h = hash_block(None, [1, 2, 3])
    assert pool.cache_block(b0, h) is True
    assert pool.cache_block(b1, h) is False
    assert pool.get_cached_block(h) is b0 and b1.block_hash is None
    assert pool.cache_block(b0, h) is True  # re-registering the same block under its hash is a no-op
    with pytest.raises(ValueError, match="already cached"):
        pool.cache_block(b0, hash_block(None, [9]))
    # The uncached duplicate is a plain block: evicting it later does not touch b0's entry.
    pool.free_blocks([b1])
    pool.get_new_blocks(1)
    assert pool.get_cached_block(h) is b0
    check_pool_invariants(pool)


def test_reset_prefix_cache() -> None:
    pool = BlockPool(4)
    b = pool.get_new_blocks(2)
    pool.cache_block(b[0], 11)
    pool.cache_block(b[1], 22)
    pool.free_blocks([b[1]])
    pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0 and pool.get_cached_block(11) is None and pool.get_cached_block(22) is None
    assert b[0].block_hash is None and b[1].block_hash is None
    assert b[0].ref_cnt == 1 and queue_ids(pool) == [2, 3, 1]  # allocation state is untouched
    check_pool_invariants(pool)


def test_caching_disabled() -> None:
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.get_new_blocks(1)
    assert pool.cache_block(b, 5) is False
    assert b.block_hash is None and pool.get_cached_block(5) is None and pool.num_cached_blocks == 0


def test_bad_pool_size() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
