"""KVCacheManager additions for the memory hierarchy: a table restored from elsewhere (swap-in) and whole blocks
dropped from the middle of a table (KV compression). Every block is accounted for: the pool's free count returns to
its size once the tables are freed."""
from __future__ import annotations

import pytest

from rooflm.kv_cache import KVCacheManager


def test_allocate_restored_takes_fresh_blocks_and_grows_like_any_table():
    kv = KVCacheManager(8, 4)
    ids = kv.allocate_restored("a", 3)
    assert len(set(ids)) == 3 and kv.num_free_blocks == 5
    assert kv.allocate_slots("a", 10, 14)  # 10 computed tokens in 3 blocks, 4 more: one new block
    assert kv.num_table_blocks("a") == 4 and kv.get_block_ids("a")[:3] == ids
    with pytest.raises(ValueError, match="already has a block table"):
        kv.allocate_restored("a", 1)
    with pytest.raises(ValueError, match="free"):
        kv.allocate_restored("b", 5)
    kv.free("a")
    assert kv.num_free_blocks == 8


def test_drop_blocks_closes_the_gap_and_frees_them():
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    assert kv.allocate_slots("a", 0, 20)
    ids = kv.get_block_ids("a")
    assert kv.drop_blocks("a", 1, 2) == ids[1:3]
    assert kv.get_block_ids("a") == [ids[0], ids[3], ids[4]]
    assert kv.num_free_blocks == 5
    for bad in ((2, 2), (-1, 1), (0, -1)):
        with pytest.raises(ValueError, match="drop_blocks"):
            kv.drop_blocks("a", *bad)
    kv.free("a")
    assert kv.num_free_blocks == 8
