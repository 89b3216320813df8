"""Paged KV-cache bookkeeping in pure Python (no torch): block pool, chained prefix hashes, per-sequence tables."""
from rooflm.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVBlock
from rooflm.kv_cache.hashing import hash_block, hash_token_blocks
from rooflm.kv_cache.manager import KVCacheManager

__all__ = ["BlockPool", "FreeBlockQueue", "KVBlock", "KVCacheManager", "hash_block", "hash_token_blocks"]
