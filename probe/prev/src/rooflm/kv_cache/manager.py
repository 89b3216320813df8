"""KVCacheManager: one block table per sequence on top of a BlockPool, with prefix caching and copy-on-write.

Slot arithmetic: token position p of a sequence lives in block ``table[p // block_size]`` at offset
``p % block_size``; the model runner turns that into a slot ``block_id * block_size + offset``.

Invariants (checked by tests/unit/test_kv_manager.py):
- every block's ref_cnt equals the number of block tables holding it (tables never hold a block twice);
- a block shared by several tables (ref_cnt > 1) is never written: before a sequence writes into a shared block,
  ``allocate_slots`` swaps in a private copy (copy-on-write) and queues the copy for the model runner;
- a cached block is full and computed, so it is never written again.

Typical use by the scheduler (one engine step)::

    hits, n_cached = kv.get_computed_blocks(seq.token_ids)          # new (or preempted) sequence only
    if not kv.allocate_slots(seq_id, n_cached, n_cached + n_new, hits):
        ...  # not admitted / preempt someone; nothing changed
    seq.num_computed_tokens = n_cached
    copies = kv.take_pending_copies()   # run in order, on the device, before the step's forward pass
    ... forward ...
    kv.cache_full_blocks(seq_id, seq.token_ids, seq.num_computed_tokens)   # after the step

Pure Python: no torch.
"""
from __future__ import annotations

from collections.abc import Sequence

from rooflm.kv_cache.block_pool import BlockPool, KVBlock
from rooflm.kv_cache.hashing import hash_block

__all__ = ["KVCacheManager"]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"KVCacheManager: block_size must be a positive integer, got {block_size!r}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        # seq_id -> its blocks, in token order.
        self.block_tables: dict[str, list[KVBlock]] = {}
        # Incremental caching state per sequence: table[:n] are known to be registered (or deliberately skipped
        # as duplicates), and the chained hash of block n-1 (None when n == 0).
        self._num_cached_blocks: dict[str, int] = {}
        self._last_block_hash: dict[str, int | None] = {}
        # (src_block_id, dst_block_id) copies queued by copy-on-write, to run before the next forward pass.
        self._pending_copies: list[tuple[int, int]] = []
        # The prefix cache's host tier (rooflm.kv_cache.host_tier.HostPrefixTier) when kv_offload_gb > 0: forgotten
        # with the device entries by reset_prefix_cache.
        self.host_tier = None
        # Prefix-cache statistics, in tokens.
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- sizes and stats --------------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Cached tokens / queried tokens over all get_computed_blocks calls (0.0 before any query)."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks covering `num_tokens` slots: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def reset_prefix_cache(self) -> None:
        """Forget all cached prefixes (blocks in use stay allocated) and the hit statistics."""
        self.block_pool.reset_prefix_cache()
        if self.host_tier is not None:
            self.host_tier.reset()
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- prefix lookup ----------------------------------------------------------------------------------------

    def get_computed_blocks(self, token_ids: Sequence[int], record: bool = True) -> tuple[list[KVBlock], int]:
        """The longest run of cached full blocks matching the start of `token_ids`, and the tokens they cover.

        Capped at ``(len(token_ids) - 1) // block_size`` blocks so at least one token is left to compute (the
        forward pass must produce logits for the last token). Takes no reference: pass the blocks to
        ``allocate_slots`` right away, before anything else can evict them. Counts in the statistics unless
        ``record`` is False (a caller that may retry records the lookup that succeeds with ``record_lookup``).
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        max_blocks = max(0, (len(token_ids) - 1) // bs)
        hashes: list[int] = []
        parent: int | None = None
        for i in range(max_blocks):
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
        return self.get_computed_blocks_by_hash(hashes, len(token_ids), record)

    def get_computed_blocks_by_hash(self, block_hashes: Sequence[int], num_tokens: int,
                                    record: bool = True) -> tuple[list[KVBlock], int]:
        """``get_computed_blocks`` for a sequence of ``num_tokens`` tokens whose full blocks' chained hashes are
        already known (a request hashes its blocks once, not at every admission attempt)."""
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = min(len(block_hashes), max(0, (num_tokens - 1) // self.block_size))
        hits: list[KVBlock] = []
        for i in range(max_blocks):
            block = self.block_pool.get_cached_block(block_hashes[i])
            if block is None:
                break
            hits.append(block)
        num_cached_tokens = len(hits) * self.block_size
        if record:
            self.record_lookup(num_tokens, num_cached_tokens)
        return hits, num_cached_tokens

    def record_lookup(self, num_tokens: int, num_cached_tokens: int) -> None:
        """Count one prefix-cache lookup of ``num_tokens`` tokens, ``num_cached_tokens`` of them found."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_cached_tokens

    # ---- allocation -------------------------------------------------------------------------------------------

    def _plan(
        self, seq_id: str, num_computed_tokens: int, num_tokens_needed: int, new_computed_blocks: Sequence[KVBlock]
    ) -> tuple[int, int, list[int]]:
        """Validate a request and count what it costs, changing nothing.

        Returns (free blocks it consumes, new blocks to append, table indices to replace by copy-on-write).
        """
        bs = self.block_size
        table = self.block_tables.get(seq_id)
        if not 0 <= num_computed_tokens <= num_tokens_needed:
            raise ValueError(
                f"allocate_slots({seq_id!r}): need 0 <= num_computed_tokens <= num_tokens_needed, "
                f"got {num_computed_tokens} and {num_tokens_needed}"
            )
        num_revived = 0
        if table is None:  # first call: the prefix hits become the head of the table
            if num_computed_tokens != len(new_computed_blocks) * bs:
                raise ValueError(
                    f"allocate_slots({seq_id!r}): a new sequence with {len(new_computed_blocks)} cached blocks "
                    f"must start at num_computed_tokens={len(new_computed_blocks) * bs}, got {num_computed_tokens}"
                )
            for block in new_computed_blocks:
                if block.block_hash is None:
                    raise ValueError(
                        f"allocate_slots({seq_id!r}): prefix block {block.block_id} is no longer cached (evicted "
                        "since get_computed_blocks); call get_computed_blocks again"
                    )
                if block.ref_cnt == 0:  # sitting in the free queue: reviving it takes one free block
                    num_revived += 1
            num_current = len(new_computed_blocks)
            shared_indices: list[int] = []  # the write range starts after the hits: nothing to copy
        else:
            if new_computed_blocks:
                raise ValueError(
                    f"allocate_slots({seq_id!r}): new_computed_blocks are only accepted on a sequence's first call"
                )
            if num_computed_tokens > len(table) * bs:
                raise ValueError(
                    f"allocate_slots({seq_id!r}): num_computed_tokens={num_computed_tokens} exceeds the "
                    f"{len(table) * bs} slots of its {len(table)} blocks"
                )
            num_current = len(table)
            # Blocks this step writes into: table[num_computed // bs : ceil(num_needed / bs)]. Any of them that is
            # shared (normally only a partly filled last block after fork) gets a private replacement.
            if num_tokens_needed > num_computed_tokens:
                first = num_computed_tokens // bs
                last = min(self.blocks_needed(num_tokens_needed), len(table))
                shared_indices = [i for i in range(first, last) if table[i].ref_cnt > 1]
            else:
                shared_indices = []
        num_new = max(0, self.blocks_needed(num_tokens_needed) - num_current)
        return num_new + num_revived + len(shared_indices), num_new, shared_indices

    def can_allocate(
        self,
        seq_id: str,
        num_computed_tokens: int,
        num_tokens_needed: int,
        new_computed_blocks: Sequence[KVBlock] = (),
    ) -> bool:
        """Whether ``allocate_slots`` with the same arguments would succeed now."""
        cost, _, _ = self._plan(seq_id, num_computed_tokens, num_tokens_needed, new_computed_blocks)
        return cost <= self.block_pool.num_free_blocks

    def allocate_slots(
        self,
        seq_id: str,
        num_computed_tokens: int,
        num_tokens_needed: int,
        new_computed_blocks: Sequence[KVBlock] = (),
    ) -> bool:
        """Make `seq_id`'s table cover `num_tokens_needed` slots in total. False (and nothing changed) if short.

        On the sequence's first call, `new_computed_blocks` (from ``get_computed_blocks``) are referenced and become
        the head of its table, and `num_computed_tokens` must equal the tokens they cover. On later calls, a shared
        block about to be written (the partly filled last block of a forked sequence) is replaced by a fresh block
        and the copy (src_block_id, dst_block_id) is queued; see ``take_pending_copies``.
        """
        cost, num_new, shared_indices = self._plan(seq_id, num_computed_tokens, num_tokens_needed, new_computed_blocks)
        pool = self.block_pool
        if cost > pool.num_free_blocks:
            return False
        # From here on nothing can fail: the pool has `cost` free blocks.
        table = self.block_tables.get(seq_id)
        if table is None:
            # Touch the hits before popping new blocks, so a hit sitting in the free queue is not evicted by our
            # own allocation.
            pool.touch(new_computed_blocks)
            table = self.block_tables[seq_id] = list(new_computed_blocks)
            self._num_cached_blocks[seq_id] = len(table)
            self._last_block_hash[seq_id] = table[-1].block_hash if table else None
        bs = self.block_size
        for i in shared_indices:  # copy-on-write
            old = table[i]
            (new,) = pool.get_new_blocks(1)
            if i * bs < num_computed_tokens:  # it holds computed tokens: their KV must be copied over
                self._pending_copies.append((old.block_id, new.block_id))
            table[i] = new
            pool.free_blocks([old])  # ref_cnt was > 1, so it stays allocated to the other tables
        if num_new:
            table.extend(pool.get_new_blocks(num_new))
        return True

    def allocate_restored(self, seq_id: str, num_blocks: int) -> list[int]:
        """A new table of ``num_blocks`` fresh blocks for a sequence whose KV comes back from elsewhere (swap-in from
        host memory); returns their ids. The caller checks ``num_free_blocks`` first."""
        if seq_id in self.block_tables:
            raise ValueError(f"allocate_restored({seq_id!r}): the sequence already has a block table")
        if num_blocks > self.block_pool.num_free_blocks:
            raise ValueError(f"allocate_restored({seq_id!r}): {num_blocks} blocks asked, "
                             f"{self.block_pool.num_free_blocks} free")
        table = self.block_tables[seq_id] = self.block_pool.get_new_blocks(num_blocks) if num_blocks else []
        self._num_cached_blocks[seq_id] = 0
        self._last_block_hash[seq_id] = None
        return [b.block_id for b in table]

    def drop_blocks(self, seq_id: str, start: int, num_blocks: int) -> list[int]:
        """Free ``num_blocks`` blocks of the sequence's table from index ``start`` on and close the gap (KV
        compression drops whole blocks from the middle of a context); returns their ids."""
        table = self._table(seq_id)
        if not (0 <= start and 0 <= num_blocks and start + num_blocks <= len(table)):
            raise ValueError(f"drop_blocks({seq_id!r}): blocks [{start}, {start + num_blocks}) are not in its "
                             f"table of {len(table)}")
        dropped = table[start:start + num_blocks]
        del table[start:start + num_blocks]
        self._num_cached_blocks[seq_id] = min(self._num_cached_blocks[seq_id], start)
        self.block_pool.free_blocks(dropped)
        return [b.block_id for b in dropped]

    # ---- prefix registration ----------------------------------------------------------------------------------

    def cache_full_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                          block_hashes: Sequence[int] | None = None) -> None:
        """Register every full block within the first `num_computed_tokens` tokens not registered yet.

        Incremental: only blocks past the sequence's cached count are hashed, chained from its last hash. With
        ``block_hashes`` (the chained hashes of the sequence's full blocks, computed once by its owner) nothing is
        hashed here.
        """
        if not self.enable_prefix_caching:
            return
        table = self._table(seq_id)
        bs = self.block_size
        if num_computed_tokens > min(len(token_ids), len(table) * bs):
            raise ValueError(
                f"cache_full_blocks({seq_id!r}): num_computed_tokens={num_computed_tokens} exceeds the "
                f"{len(token_ids)} tokens given or the {len(table) * bs} slots of the table"
            )
        num_full = num_computed_tokens // bs
        start = self._num_cached_blocks[seq_id]
        if num_full <= start:
            return
        parent = self._last_block_hash[seq_id]
        for i in range(start, num_full):
            if block_hashes is not None:
                parent = block_hashes[i]
            else:
                parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            # A duplicate (the same prefix already cached by another block) is left uncached; the chain goes on
            # with the hash value, so the blocks after it are still registered.
            self.block_pool.cache_block(table[i], parent)
        self._num_cached_blocks[seq_id] = num_full
        self._last_block_hash[seq_id] = parent

    # ---- sequence lifetime ------------------------------------------------------------------------------------

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give `child_id` the parent's blocks (each ref + 1): n > 1 samples share the prompt's KV."""
        table = self._table(parent_id)
        if child_id in self.block_tables:
            raise ValueError(f"fork: sequence {child_id!r} already has a block table")
        self.block_pool.touch(table)
        self.block_tables[child_id] = list(table)
        self._num_cached_blocks[child_id] = self._num_cached_blocks[parent_id]
        self._last_block_hash[child_id] = self._last_block_hash[parent_id]

    def free(self, seq_id: str) -> None:
        """Drop the sequence's table; its blocks are freed last-first. Unknown ids are ignored."""
        table = self.block_tables.pop(seq_id, None)
        if table is None:
            return
        del self._num_cached_blocks[seq_id]
        del self._last_block_hash[seq_id]
        # Reverse order: under LRU the sequence's last blocks are evicted before its first ones, whose prefixes
        # are the most likely to be shared by later requests.
        self.block_pool.free_blocks(reversed(table))
        if self._pending_copies:
            # A copy into a block this sequence owned alone is moot now that the block is free.
            freed = {b.block_id for b in table if b.ref_cnt == 0}
            self._pending_copies = [(s, d) for s, d in self._pending_copies if d not in freed]

    # ---- views for the scheduler / model runner ---------------------------------------------------------------

    def _table(self, seq_id: str) -> list[KVBlock]:
        try:
            return self.block_tables[seq_id]
        except KeyError:
            raise KeyError(f"KVCacheManager: no block table for sequence {seq_id!r}") from None

    def get_block_ids(self, seq_id: str, start: int = 0) -> list[int]:
        """The block ids of the sequence's table from index ``start`` on, in token order. KeyError for an unknown
        sequence."""
        table = self._table(seq_id)
        return [table[i].block_id for i in range(start, len(table))]

    def num_table_blocks(self, seq_id: str) -> int:
        return len(self._table(seq_id))

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Return and clear the queued (src_block_id, dst_block_id) copies; run them in order before the forward."""
        copies, self._pending_copies = self._pending_copies, []
        return copies
