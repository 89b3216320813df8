"""The host tier of the prefix cache (``kv_offload_gb``): cached blocks evicted from the device pool live on in host
memory, keyed by their chained hash, and come back when a later prompt's prefix misses on the device but hits here.

vLLM's CPU offloading connector and LMCache do the same: a prefix cache as large as host memory, at the price of a
host-to-device copy instead of a prefill. A hit costs ``b · B / BW`` (``b`` blocks of ``B`` bytes over the host
link) where a recompute costs a prefill of ``b · block_size`` tokens; on a GPU the copy is one to two orders of
magnitude cheaper, on a CPU it is a memcpy against a forward pass.

This module is the scheduler's side, pure Python like the rest of ``rooflm.kv_cache``: it owns the host block ids
and the hash -> host block map (least recently used first), and queues the copies. ``BlockPool.on_evict`` calls
``offload`` when a cached device block is popped for reuse; the scheduler calls ``hold`` / ``restore`` /
``release`` when it admits a request (``Scheduler._admit_waiting``). The copies of a step leave in
``SchedulerOutput.kv_offload_out`` / ``kv_offload_in``; the runner (``rooflm.worker.kv_offload``) performs them
before the forward pass with the swap machinery (``HostSwapSpace``): offloads first (they read device blocks that
this step may hand out again), restores last (they write fresh device blocks).

Host blocks that a copy of the pending step reads or writes are *busy* until ``take``: the host LRU never reuses
them, so one step never writes a host block twice or overwrites one a restore still reads. When every host block
is busy an evicted block is simply dropped (the prefix is recomputed if it comes again).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["HostPrefixTier", "HostTierStats"]


@dataclass
class HostTierStats:
    hit_tokens: int = 0  # prompt tokens restored from host memory instead of computed
    miss_tokens: int = 0  # full-block prompt tokens that missed on the device and on the host
    blocks_offloaded: int = 0  # device -> host copies
    blocks_restored: int = 0  # host -> device copies
    bytes_offloaded: int = 0
    bytes_restored: int = 0
    evictions: int = 0  # host entries dropped (least recently used) to make room


class HostPrefixTier:
    """``num_host_blocks`` host blocks holding evicted prefix blocks, looked up by chained block hash."""

    def __init__(self, num_host_blocks: int, block_size: int, bytes_per_block: int = 1) -> None:
        if not isinstance(num_host_blocks, int) or num_host_blocks < 1:
            raise ValueError(f"num_host_blocks={num_host_blocks!r} is invalid: expected a positive integer")
        self.num_host_blocks = num_host_blocks
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self._free: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self._lru: OrderedDict[int, int] = OrderedDict()  # block hash -> host block, least recently used first
        self._busy: set[int] = set()  # host blocks read or written by the pending step's copies
        self._held: set[int] = set()  # host blocks matched by an admission that is still allocating
        self._orphans: list[int] = []  # busy host blocks forgotten by ``reset``: free after ``take``
        self._out: list[tuple[int, int]] = []  # (device block, host block)
        self._in: list[tuple[int, int]] = []  # (host block, device block)
        self.stats = HostTierStats()

    # -- state --------------------------------------------------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        return len(self._lru)

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._free)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    # -- device eviction ----------------------------------------------------------------------------------------------
    def offload(self, device_block_id: int, block_hash: int) -> None:
        """A cached device block is being reused: keep its KV under ``block_hash`` (a copy queued for this step)."""
        if block_hash in self._lru:  # already here (restored earlier, or offloaded before): just refresh it
            self._lru.move_to_end(block_hash)
            return
        host = self._allocate()
        if host is None:
            return
        self._lru[block_hash] = host
        self._busy.add(host)
        self._out.append((device_block_id, host))
        self.stats.blocks_offloaded += 1
        self.stats.bytes_offloaded += self.bytes_per_block

    def _allocate(self) -> int | None:
        if self._free:
            return self._free.pop()
        for block_hash, host in self._lru.items():  # least recently used first
            if host not in self._busy and host not in self._held:
                del self._lru[block_hash]
                self.stats.evictions += 1
                return host
        return None

    # -- admission ----------------------------------------------------------------------------------------------------
    def hold(self, block_hashes: Sequence[int], start: int, stop: int) -> list[int]:
        """The hashes ``block_hashes[start:stop]`` found here, in order up to the first miss; they are held (not
        reused by ``offload``) until ``restore`` or ``release``. Nothing is counted yet."""
        found: list[int] = []
        for i in range(start, stop):
            host = self._lru.get(block_hashes[i])
            if host is None:
                break
            found.append(block_hashes[i])
            self._held.add(host)
        return found

    def release(self, held: Sequence[int]) -> None:
        """The admission that held these hashes did not go through."""
        for block_hash in held:
            host = self._lru.get(block_hash)
            if host is not None:
                self._held.discard(host)

    def restore(self, held: Sequence[int], device_block_ids: Sequence[int], num_missed_blocks: int = 0) -> None:
        """Queue the copies of the held hashes into ``device_block_ids`` (as many, in order); count the lookup:
        ``num_missed_blocks`` full blocks after them were found nowhere."""
        if len(held) != len(device_block_ids):
            raise ValueError(f"restore: {len(device_block_ids)} device blocks for {len(held)} host blocks")
        for block_hash, dev in zip(held, device_block_ids):
            host = self._lru[block_hash]
            self._lru.move_to_end(block_hash)
            self._held.discard(host)
            self._busy.add(host)
            self._in.append((host, dev))
        n = len(held)
        self.stats.blocks_restored += n
        self.stats.bytes_restored += n * self.bytes_per_block
        self.stats.hit_tokens += n * self.block_size
        self.stats.miss_tokens += num_missed_blocks * self.block_size

    def take(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's (offload, restore) copies; their host blocks may be reused from now on."""
        out, inn = self._out, self._in
        self._out, self._in = [], []
        self._busy.clear()
        self._free.extend(self._orphans)
        self._orphans = []
        return out, inn

    def reset(self) -> None:
        """Forget every host entry (``reset_prefix_cache``); copies already queued still run, and their host blocks
        are free once the step is taken."""
        for host in self._lru.values():
            (self._orphans if host in self._busy else self._free).append(host)
        self._lru.clear()
        self._held.clear()
