"""The pool of KV blocks: reference counts, a free queue in LRU order, and the prefix-cache map.

Invariants (checked by tests/unit/test_block_pool.py):
- a block is in the free queue  iff  its ref_cnt == 0;
- the free queue is ordered by eviction priority: the head is the next block handed out (least recently freed);
- ``block.block_hash is not None``  iff  ``cached_block_hash_to_block[block.block_hash] is block``: a block is
  registered under at most one hash, and a hash names at most one block;
- a cached block keeps its hash while free (it can still be hit and revived) until it is popped for reuse.

Pure Python: no torch. The device-side KV tensors are indexed by ``block_id`` elsewhere.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

__all__ = ["KVBlock", "FreeBlockQueue", "BlockPool"]


@dataclass(slots=True, eq=False)  # eq=False: blocks compare and hash by identity
class KVBlock:
    block_id: int
    ref_cnt: int = 0  # number of block tables holding this block
    block_hash: int | None = None  # chained hash while registered in the prefix cache, else None
    # Links of the free queue; both None iff the block is not in it (the queue uses sentinels at its ends).
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append and remove of any block.

    The head is the least recently freed block (evicted first); ``append`` puts a block at the tail.
    Sentinel nodes at both ends mean every queued block has non-None links, which doubles as the membership test.
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(block_id=-1)  # sentinels, never handed out
        self._tail = KVBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __contains__(self, block: KVBlock) -> bool:
        return block.prev_free is not None

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("FreeBlockQueue.popleft: no free blocks left")
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"FreeBlockQueue.append: block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"FreeBlockQueue.remove: block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def block_ids(self) -> list[int]:
        """Ids from head (next to be evicted) to tail; for tests and debugging, O(n)."""
        return [b.block_id for b in self]


class BlockPool:
    """All KV blocks of the cache, their reference counts, the free queue and the prefix-cache map."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"BlockPool: num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVBlock] = [KVBlock(block_id=i) for i in range(num_blocks)]
        # Initially every block is free, handed out in id order.
        self.free_block_queue = FreeBlockQueue(self.blocks)
        # Prefix cache: chained hash of a full block -> the block holding that KV content.
        self.cached_block_hash_to_block: dict[int, KVBlock] = {}
        # Called with (block_id, block_hash) when a cached block is popped for reuse, before anything overwrites it:
        # the host tier of the prefix cache keeps its KV (rooflm.kv_cache.host_tier). None: the KV is lost.
        self.on_evict: Callable[[int, int], None] | None = None

    # ---- allocation -------------------------------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Pop `num_blocks` blocks from the head of the free queue, each returned with ref_cnt 1.

        A popped block that was still cached loses its hash and its entry in the prefix-cache map (eviction).
        """
        if num_blocks < 0:
            raise ValueError(f"get_new_blocks: num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"get_new_blocks: asked for {num_blocks} blocks but only "
                f"{self.free_block_queue.num_free_blocks} of {self.num_blocks} are free"
            )
        out: list[KVBlock] = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            assert block.ref_cnt == 0, f"block {block.block_id} in the free queue with ref_cnt {block.ref_cnt}"
            self._evict_cached(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict_cached(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        cached = self.cached_block_hash_to_block.pop(block.block_hash, None)
        assert cached is block, f"block {block.block_id} has a hash the prefix-cache map does not give to it"
        if self.on_evict is not None:
            self.on_evict(block.block_id, block.block_hash)
        block.block_hash = None

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block; a free (ref 0) block leaves the free queue: a prefix hit revives it."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block; those reaching 0 join the free-queue tail in the given order.

        Pass a sequence's blocks last-first so that its tail blocks are evicted before its (more shareable) head.
        A cached block keeps its hash while free, so it can still be hit until it is evicted.
        """
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"free_blocks: block {block.block_id} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    # ---- prefix cache -----------------------------------------------------------------------------------------

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        """The block registered under `block_hash`, or None. Takes no reference."""
        if not self.enable_caching:
            return None
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_block(self, block: KVBlock, block_hash: int) -> bool:
        """Register a full, computed block under its chained hash. Returns whether this block is now the entry.

        If another block already holds that hash (the same prefix was computed twice, concurrently), the existing
        entry stays and this block remains uncached: it is freed and reused like any private block.
        """
        if not self.enable_caching:
            return False
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise ValueError(
                    f"cache_block: block {block.block_id} is already cached under hash {block.block_hash:#x}, "
                    f"cannot re-register it under {block_hash:#x}"
                )
            return True  # already registered (e.g. by a forked sequence sharing this block)
        if block_hash in self.cached_block_hash_to_block:
            return False
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash. Blocks in use stay allocated (they just can no longer be hit)."""
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()

    # ---- accounting -------------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0 (including cached ones that a hit could still revive)."""
        return self.free_block_queue.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_block_hash_to_block)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by at least one block table (ref_cnt > 0)."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_blocks
