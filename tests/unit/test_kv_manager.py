"""KVCacheManager: allocation, prefix hits (chained, capped), copy-on-write, free order, and a no-leak property test."""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rooflm.kv_cache import KVCacheManager, hash_token_blocks

BS = 4


def toks(*blocks: int, tail: int = 0, base: int = 0) -> list[int]:
    """Tokens made of full blocks, block k filled with the value k (+ base), then `tail` extra tokens."""
    out = [v for k in blocks for v in [k] * BS]
    return out + list(range(1000 + base, 1000 + base + tail))


def refs(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.block_pool.blocks]


def queue(kv: KVCacheManager) -> list[int]:
    return kv.block_pool.free_block_queue.block_ids()


def snapshot(kv: KVCacheManager) -> tuple:
    """Everything observable about the manager's state."""
    pool = kv.block_pool
    return (
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        queue(kv),
        {h: b.block_id for h, b in pool.cached_block_hash_to_block.items()},
        {s: [b.block_id for b in t] for s, t in kv.block_tables.items()},
        dict(kv._num_cached_blocks),
        dict(kv._last_block_hash),
        list(kv._pending_copies),
    )


def check_invariants(kv: KVCacheManager) -> None:
    pool = kv.block_pool
    held = Counter(b.block_id for t in kv.block_tables.values() for b in t)
    for t in kv.block_tables.values():
        assert len({b.block_id for b in t}) == len(t), "a table holds a block twice"
    q = queue(kv)
    assert len(q) == len(set(q)) == kv.num_free_blocks
    for b in pool.blocks:
        assert b.ref_cnt == held[b.block_id], f"block {b.block_id}: ref_cnt {b.ref_cnt} != {held[b.block_id]} tables"
        assert (b.block_id in q) == (b.ref_cnt == 0)
        if b.block_hash is not None:
            assert pool.cached_block_hash_to_block[b.block_hash] is b
    assert all(b.block_hash == h for h, b in pool.cached_block_hash_to_block.items())
    assert kv.usage == pytest.approx(sum(1 for b in pool.blocks if b.ref_cnt) / kv.num_blocks)


def run_prefill(kv: KVCacheManager, seq: str, tokens: list[int]) -> list[int]:
    """Admit `tokens` with prefix hits, compute them all, cache full blocks. Returns the block ids."""
    hits, n = kv.get_computed_blocks(tokens)
    assert kv.allocate_slots(seq, n, len(tokens), hits)
    kv.cache_full_blocks(seq, tokens, len(tokens))
    return kv.get_block_ids(seq)


# ---- allocation ------------------------------------------------------------------------------------------------


def test_allocation_grows_block_by_block() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    assert kv.num_blocks == 8 and kv.block_size == BS
    assert [kv.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert kv.allocate_slots("a", 0, 5)
    assert kv.get_block_ids("a") == [0, 1]
    assert kv.allocate_slots("b", 0, 3)
    assert kv.get_block_ids("b") == [2]
    assert kv.allocate_slots("a", 5, 8)  # still fits in two blocks
    assert kv.get_block_ids("a") == [0, 1] and kv.num_free_blocks == 5
    assert kv.allocate_slots("a", 8, 9)
    assert kv.get_block_ids("a") == [0, 1, 3]
    assert kv.allocate_slots("b", 3, 3)  # nothing new to write
    assert kv.get_block_ids("b") == [2]
    assert refs(kv) == [1, 1, 1, 1, 0, 0, 0, 0] and kv.usage == 0.5
    assert kv.take_pending_copies() == []
    check_invariants(kv)


def test_allocate_short_returns_false_and_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    run_prefill(kv, "a", toks(1, 2, 3))  # blocks 0,1,2 cached
    kv.free("a")  # queue: 3 4 5 2 1 0, all cached blocks revivable
    assert queue(kv) == [3, 4, 5, 2, 1, 0]
    assert kv.allocate_slots("x", 0, 8)  # takes 3, 4
    before = snapshot(kv)
    free_before = kv.num_free_blocks
    assert free_before == 4

    # 3 hits, all sitting in the free queue, + 2 new blocks = 5 free blocks needed, 4 available.
    hits, n = kv.get_computed_blocks(toks(1, 2, 3, tail=5))
    assert [b.block_id for b in hits] == [0, 1, 2] and n == 12
    stats = (kv.prefix_queries, kv.prefix_hits)
    assert not kv.can_allocate("b", n, 17, hits)
    assert not kv.allocate_slots("b", n, 17, hits)
    assert snapshot(kv) == before and kv.num_free_blocks == free_before
    assert "b" not in kv.block_tables and [h.ref_cnt for h in hits] == [0, 0, 0]
    # A growing sequence that does not fit changes nothing either.
    assert not kv.allocate_slots("x", 8, 8 + 5 * BS)
    assert snapshot(kv) == before
    assert (kv.prefix_queries, kv.prefix_hits) == stats

    # One block fewer fits exactly: hits revived first, so the allocation cannot evict them.
    assert kv.can_allocate("b", n, 16, hits)
    assert kv.allocate_slots("b", n, 16, hits)
    assert kv.get_block_ids("b") == [0, 1, 2, 5] and kv.num_free_blocks == 0
    assert kv.block_pool.num_cached_blocks == 3
    check_invariants(kv)


def test_allocate_validates_arguments() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    run_prefill(kv, "a", toks(1, 2))
    hits, n = kv.get_computed_blocks(toks(1, 2, tail=1))
    assert n == 8
    with pytest.raises(ValueError, match="must start at num_computed_tokens=8"):
        kv.allocate_slots("b", 0, 9, hits)
    with pytest.raises(ValueError, match="num_computed_tokens <= num_tokens_needed"):
        kv.allocate_slots("a", 8, 7)
    with pytest.raises(ValueError, match="first call"):
        kv.allocate_slots("a", 8, 9, hits)
    with pytest.raises(ValueError, match="exceeds"):
        kv.allocate_slots("a", 9, 10)
    with pytest.raises(KeyError):
        kv.get_block_ids("nope")
    kv.free("nope")  # unknown id: no-op
    check_invariants(kv)


# ---- prefix caching --------------------------------------------------------------------------------------------


def test_prefix_hit_is_capped_to_leave_one_token() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = toks(1, 2, 3)  # exactly 3 full blocks
    assert run_prefill(kv, "a", prompt) == [0, 1, 2]
    hits, n = kv.get_computed_blocks(prompt)
    assert [b.block_id for b in hits] == [0, 1] and n == 8  # k full blocks hit only k - 1
    hits, n = kv.get_computed_blocks(prompt + [99])
    assert [b.block_id for b in hits] == [0, 1, 2] and n == 12
    assert kv.get_computed_blocks(prompt[:1]) == ([], 0)
    assert kv.get_computed_blocks([]) == ([], 0)
    assert [b.ref_cnt for b in kv.block_pool.blocks[:3]] == [1, 1, 1]  # lookups take no reference


def test_hit_after_other_sequence_freed() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = toks(1, 2, 3, tail=2)
    assert run_prefill(kv, "a", prompt) == [0, 1, 2, 3]
    assert kv.block_pool.num_cached_blocks == 3  # the partial block 3 is not cached
    kv.free("a")
    assert refs(kv) == [0] * 8 and queue(kv) == [4, 5, 6, 7, 3, 2, 1, 0]

    hits, n = kv.get_computed_blocks(prompt)
    assert [b.block_id for b in hits] == [0, 1, 2] and n == 12
    assert kv.allocate_slots("b", n, len(prompt), hits)
    assert kv.get_block_ids("b") == [0, 1, 2, 4]  # revived hits + one fresh block from the head
    assert refs(kv) == [1, 1, 1, 0, 1, 0, 0, 0]
    assert queue(kv) == [5, 6, 7, 3] and kv.num_free_blocks == 4
    # While "b" holds them, another sequence shares them.
    hits2, n2 = kv.get_computed_blocks(prompt)
    assert kv.allocate_slots("c", n2, len(prompt), hits2)
    assert kv.get_block_ids("c") == [0, 1, 2, 5]
    assert refs(kv) == [2, 2, 2, 0, 1, 1, 0, 0]
    check_invariants(kv)


def test_partial_prefix_match() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    run_prefill(kv, "a", toks(1, 2, 3, 4))
    hits, n = kv.get_computed_blocks(toks(1, 2, 7, 4, tail=3))  # diverges in the third block
    assert [b.block_id for b in hits] == [0, 1] and n == 8
    # Divergence inside a block: that block does not hit.
    hits, n = kv.get_computed_blocks(toks(1, 2) + [3, 3, 3, 9] + [0])
    assert [b.block_id for b in hits] == [0, 1] and n == 8


def test_chained_hash_same_block_different_prefix_does_not_hit() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    run_prefill(kv, "a", toks(1, 2, tail=1))  # blocks [1][2] cached
    hits, n = kv.get_computed_blocks(toks(5, 2, tail=1))  # block [2] after a different first block
    assert hits == [] and n == 0
    hits, n = kv.get_computed_blocks(toks(2, 1, tail=1))  # same blocks, other order
    assert hits == [] and n == 0


def test_cache_full_blocks_is_incremental_and_matches_full_hashing() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = toks(1, 2, 3, tail=3)  # 15 tokens
    assert kv.allocate_slots("a", 0, len(prompt))
    for done in (3, 4, 9, 11, 15):  # chunked prefill
        kv.cache_full_blocks("a", prompt, done)
        assert kv._num_cached_blocks["a"] == done // BS
    want = hash_token_blocks(prompt, BS)
    assert len(want) == 3
    assert [kv.block_pool.get_cached_block(h).block_id for h in want] == [0, 1, 2]
    # Decode tokens that fill the last block get cached too.
    seq = prompt + [7]
    assert kv.allocate_slots("a", 15, 16)
    kv.cache_full_blocks("a", seq, 16)
    assert kv.block_pool.get_cached_block(hash_token_blocks(seq, BS)[3]).block_id == 3
    with pytest.raises(ValueError, match="exceeds"):
        kv.cache_full_blocks("a", seq, 17)


def test_duplicate_prefix_computed_twice_keeps_first_entry() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = toks(1, 2, tail=1)
    # Both admitted before either has cached anything: no hit for "b".
    assert kv.allocate_slots("a", 0, len(prompt)) and kv.allocate_slots("b", 0, len(prompt))
    kv.cache_full_blocks("a", prompt, len(prompt))
    kv.cache_full_blocks("b", prompt, len(prompt))
    assert [b.block_id for b in kv.get_computed_blocks(prompt)[0]] == [0, 1]
    assert all(b.block_hash is None for b in kv.block_tables["b"])
    # "b" keeps chaining after its uncached duplicates: its later block is still registered.
    seq = prompt + [5, 6, 7]
    assert kv.allocate_slots("b", 9, 12)
    kv.cache_full_blocks("b", seq, 12)
    hits, _ = kv.get_computed_blocks(seq + [0])
    assert [b.block_id for b in hits] == [0, 1, 5]
    check_invariants(kv)


def test_lru_eviction_prefers_sequence_tail_blocks() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    prompt = toks(1, 2, 3)
    run_prefill(kv, "a", prompt)
    kv.free("a")
    assert queue(kv) == [3, 4, 2, 1, 0]  # reverse free order: the sequence's last block goes first
    assert kv.allocate_slots("c", 0, 3 * BS)  # unrelated: takes 3, 4 and evicts cached block 2
    assert kv.get_block_ids("c") == [3, 4, 2]
    assert kv.block_pool.blocks[2].block_hash is None and kv.block_pool.num_cached_blocks == 2
    hits, n = kv.get_computed_blocks(prompt + [0])
    assert [b.block_id for b in hits] == [0, 1] and n == 8


def test_hit_rate_stats() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    assert kv.prefix_cache_hit_rate == 0.0
    prompt = toks(1, 2, tail=2)  # 10 tokens
    run_prefill(kv, "a", prompt)  # 10 queried, 0 hit
    hits, n = kv.get_computed_blocks(prompt)  # 10 queried, 8 hit
    assert (kv.prefix_queries, kv.prefix_hits) == (20, 8)
    assert kv.prefix_cache_hit_rate == pytest.approx(8 / 20)
    kv.reset_prefix_cache()
    assert kv.prefix_cache_hit_rate == 0.0 and kv.block_pool.num_cached_blocks == 0
    assert kv.get_computed_blocks(prompt) == ([], 0)
    assert kv.get_block_ids("a") == [0, 1, 2]  # allocation untouched by the reset


def test_caching_disabled() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    prompt = toks(1, 2, tail=1)
    assert run_prefill(kv, "a", prompt) == [0, 1, 2]
    assert kv.get_computed_blocks(prompt) == ([], 0)
    assert kv.block_pool.num_cached_blocks == 0 and kv.prefix_queries == 0
    kv.free("a")
    assert kv.num_free_blocks == 8


# ---- fork, copy-on-write, free ---------------------------------------------------------------------------------


def test_fork_and_copy_on_write() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    prompt = toks(1, tail=2)  # 6 tokens: block 0 full, block 1 holds 2 tokens
    assert run_prefill(kv, "p", prompt) == [0, 1]
    kv.fork("p", "c")
    assert kv.get_block_ids("c") == [0, 1] and refs(kv)[:2] == [2, 2]
    with pytest.raises(ValueError, match="already"):
        kv.fork("p", "c")

    # Nothing to write yet: no copy.
    assert kv.allocate_slots("c", 6, 6) and kv.take_pending_copies() == []
    # The child writes token 6 into the shared, partly filled block 1: it gets a private copy.
    assert kv.allocate_slots("c", 6, 7)
    assert kv.get_block_ids("c") == [0, 2] and kv.get_block_ids("p") == [0, 1]
    assert refs(kv) == [2, 1, 1, 0, 0, 0]
    assert kv.take_pending_copies() == [(1, 2)]
    assert kv.take_pending_copies() == []  # taken and cleared
    # The parent now owns block 1 alone: it writes in place.
    assert kv.allocate_slots("p", 6, 7)
    assert kv.get_block_ids("p") == [0, 1] and kv.take_pending_copies() == []
    check_invariants(kv)

    kv.free("c")
    kv.free("p")
    assert refs(kv) == [0] * 6 and kv.num_free_blocks == 6


def test_forked_sequence_caches_its_own_blocks_chained() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    run_prefill(kv, "p", toks(1, tail=1))  # block 0 cached, block 1 partial
    kv.fork("p", "c")
    seq = toks(1) + [1000, 7, 7, 7, 8]
    assert kv.allocate_slots("c", 5, 9)
    assert kv.get_block_ids("c") == [0, 2, 3] and kv.take_pending_copies() == [(1, 2)]
    kv.cache_full_blocks("c", seq, 9)
    hits, n = kv.get_computed_blocks(seq + [0])
    assert [b.block_id for b in hits] == [0, 2] and n == 8
    # The child's block chains from the shared prefix: alone, its tokens do not hit.
    assert kv.get_computed_blocks(seq[BS : 2 * BS] + [0]) == ([], 0)


def test_fork_at_block_boundary_needs_no_copy() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    run_prefill(kv, "p", toks(1, 2))
    kv.fork("p", "c")
    assert kv.allocate_slots("c", 8, 9)
    assert kv.get_block_ids("c") == [0, 1, 2] and kv.take_pending_copies() == []
    assert refs(kv) == [2, 2, 1, 0, 0, 0]


def test_copy_on_write_counts_its_block_and_fails_cleanly() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    run_prefill(kv, "p", toks(1, tail=2))  # blocks 0, 1
    kv.fork("p", "c")
    assert kv.allocate_slots("x", 0, 1)  # takes the last free block
    before = snapshot(kv)
    assert not kv.can_allocate("c", 6, 7)
    assert not kv.allocate_slots("c", 6, 7)  # needs one block for the copy
    assert snapshot(kv) == before and refs(kv) == [2, 2, 1]
    kv.free("x")
    assert kv.can_allocate("c", 6, 7) and kv.allocate_slots("c", 6, 7)
    assert kv.get_block_ids("c") == [0, 2] and kv.take_pending_copies() == [(1, 2)]


def test_fork_of_reserved_empty_block_replaces_without_copy() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    assert kv.allocate_slots("p", 0, 9)  # blocks 0, 1, 2 reserved
    kv.cache_full_blocks("p", toks(1, 2, tail=1), 4)  # only the first 4 tokens computed
    kv.fork("p", "c")
    # The child writes tokens 4..9: block 1 (empty, shared) and block 2 (empty, shared) are replaced, no copy.
    assert kv.allocate_slots("c", 4, 10)
    assert kv.get_block_ids("c") == [0, 3, 4] and kv.take_pending_copies() == []
    assert refs(kv)[:5] == [2, 1, 1, 1, 1]
    check_invariants(kv)


def test_free_drops_moot_pending_copy() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    run_prefill(kv, "p", toks(1, tail=2))
    kv.fork("p", "c")
    assert kv.allocate_slots("c", 6, 7)
    kv.free("c")  # preempted in the same step: its private copy is gone
    assert kv.take_pending_copies() == []
    assert refs(kv) == [1, 1, 0, 0, 0, 0]


def test_free_returns_blocks_in_reverse_order() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    assert kv.allocate_slots("a", 0, 12)  # 0, 1, 2
    assert kv.allocate_slots("b", 0, 8)  # 3, 4
    kv.free("a")
    assert queue(kv) == [5, 6, 7, 2, 1, 0]
    kv.free("b")
    assert queue(kv) == [5, 6, 7, 2, 1, 0, 4, 3]
    assert "a" not in kv.block_tables and kv.num_free_blocks == 8 and kv.usage == 0.0


# ---- property test: random allocate / compute / fork / free against a simulated device -------------------------

PREFIXES = [toks(1, 2, 3, base=0), toks(1, 2, 5), toks(4, 4), []]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), num_blocks=st.integers(4, 14), caching=st.booleans())
def test_random_ops_never_leak_and_keep_refcounts_exact(data, num_blocks: int, caching: bool) -> None:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BS, enable_prefix_caching=caching)
    # The KV "tensor": a slot holds what real KV depends on, the whole prefix up to and including its token.
    device: dict[int, list[tuple | None]] = {i: [None] * BS for i in range(num_blocks)}
    seqs: dict[str, dict] = {}  # seq_id -> {"tokens": [...], "computed": int}
    counter = iter(range(10**6))

    def apply_copies() -> None:
        for src, dst in kv.take_pending_copies():
            assert kv.block_pool.blocks[dst].ref_cnt == 1
            device[dst] = list(device[src])

    def compute(sid: str, start: int, end: int) -> None:
        """The forward pass: write KV (here: the token id) of positions start..end-1 into the table's slots."""
        table = kv.block_tables[sid]
        for p in range(start, end):
            block = table[p // BS]
            assert block.ref_cnt == 1, "wrote into a shared block"
            assert block.block_hash is None, "wrote into a cached block"
            device[block.block_id][p % BS] = tuple(seqs[sid]["tokens"][: p + 1])
        seqs[sid]["computed"] = end
        kv.cache_full_blocks(sid, seqs[sid]["tokens"], end)
        if end == len(seqs[sid]["tokens"]):  # sampled the next token(s) (several: speculative decoding)
            seqs[sid]["tokens"] += data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=4))

    def lookup(tokens: list[int]) -> tuple[list, int]:
        hits, n = kv.get_computed_blocks(tokens)
        assert n == len(hits) * BS < len(tokens)
        for i, b in enumerate(hits):  # a hit holds exactly the KV of this prompt's prefix
            assert device[b.block_id] == [tuple(tokens[: p + 1]) for p in range(i * BS, (i + 1) * BS)]
        return hits, n

    def step(sid: str, start: int, hits=()) -> None:
        s = seqs.get(sid) or {"tokens": [], "computed": 0}
        room = len(s["tokens"]) - start
        n_new = data.draw(st.integers(1, room))
        before = snapshot(kv)
        ok = kv.allocate_slots(sid, start, start + n_new, hits)
        if not ok:
            assert snapshot(kv) == before
            return
        seqs[sid] = s
        apply_copies()
        # Sometimes compute fewer tokens than reserved (the table then reaches past the computed tokens).
        n_done = data.draw(st.integers(min(1, n_new), n_new))
        compute(sid, start, start + n_done)

    for _ in range(data.draw(st.integers(1, 40))):
        op = data.draw(st.sampled_from(["add", "add", "step", "step", "fork", "free", "probe"]))
        if op == "add":
            sid = f"s{next(counter)}"
            tokens = data.draw(st.sampled_from(PREFIXES))[: data.draw(st.integers(0, 12))]
            tokens = tokens + data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=9))
            hits, n = lookup(tokens)
            seqs[sid] = {"tokens": tokens, "computed": n}
            step(sid, n, hits)
            if sid not in kv.block_tables:
                del seqs[sid]
        elif op == "step" and seqs:
            sid = data.draw(st.sampled_from(sorted(seqs)))
            step(sid, seqs[sid]["computed"])
        elif op == "fork" and seqs:
            parent = data.draw(st.sampled_from(sorted(seqs)))
            child = f"s{next(counter)}"
            kv.fork(parent, child)
            p = seqs[parent]
            tail = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=8))
            seqs[child] = {"tokens": p["tokens"][: p["computed"]] + tail, "computed": p["computed"]}
        elif op == "probe" and seqs:
            # Another sequence's tokens from any block boundary on: a wrong hash chain would hit wrong KV here.
            s = seqs[data.draw(st.sampled_from(sorted(seqs)))]
            start = data.draw(st.integers(0, s["computed"] // BS)) * BS
            lookup(s["tokens"][start : s["computed"]] + [0])
        elif op == "free" and seqs:
            sid = data.draw(st.sampled_from(sorted(seqs)))
            kv.free(sid)
            del seqs[sid]
        check_invariants(kv)
        # Every sequence reads back its own tokens from the slots of its computed positions.
        for sid, s in seqs.items():
            table = kv.block_tables[sid]
            got = [device[table[p // BS].block_id][p % BS] for p in range(s["computed"])]
            assert got == [tuple(s["tokens"][: p + 1]) for p in range(s["computed"])], f"{sid} reads wrong KV"

    for sid in list(seqs):
        kv.free(sid)
    assert kv.block_tables == {}
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert kv.num_free_blocks == kv.num_blocks and kv.usage == 0.0
    check_invariants(kv)
