"""`BlockManager`: the paged KV cache's bookkeeping, tested as pure Python (no tensors).

`Pool` below stands in for the KV tensors: it records which token each block slot holds, applies the
copy-on-write pairs `allocate` leaves for `take_copies`, and so checks that no holder ever sees its cached tokens change.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from engine.cache.block_manager import BlockManager, KVSequence, NoFreeBlocks
from engine.errors import EngineError


# ---------------------------------------------------------------------------------------------------
# helpers


class Pool:
    """What the KV tensors would hold: block → {offset: token}, written the way `Runner.step` writes."""

    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.slots: dict[int, dict[int, int]] = {}

    def compute(self, seq: KVSequence, end: int | None = None) -> list[tuple[int, int]]:
        """Runner.step for one row: allocate, copy-on-write, write tokens [num_computed, end), commit."""
        end = len(seq.tokens) if end is None else end
        start = seq.num_computed
        self.bm.allocate(seq, end)
        copies = self.bm.take_copies()
        for src, dst in copies:
            self.slots[dst] = dict(self.slots.get(src, {}))
        bs = self.bm.block_size
        for p in range(start, end):
            self.slots.setdefault(seq.block_table[p // bs], {})[p % bs] = seq.tokens[p]
        seq.num_computed = end
        self.bm.commit(seq)
        return copies

    def assert_holds(self, seq: KVSequence) -> None:
        """Every computed token of `seq` is in its blocks, at its slot."""
        bs = self.bm.block_size
        assert len(seq.block_table) >= -(-seq.num_computed // bs)
        for p in range(seq.num_computed):
            got = self.slots.get(seq.block_table[p // bs], {}).get(p % bs)
            assert got == seq.tokens[p], f"position {p}: block {seq.block_table[p // bs]} holds {got}, not {seq.tokens[p]}"


def new(bm: BlockManager, tokens, max_tokens: int | None = None) -> KVSequence:
    seq = KVSequence(list(tokens))
    bm.match_prefix(seq, len(seq.tokens) if max_tokens is None else max_tokens)
    return seq


def check_invariants(bm: BlockManager, live: list[KVSequence], pool: Pool | None = None) -> None:
    """Each block is exactly one of free / evictable (refcount 0, registered) / referenced (refcount = holders)."""
    free, evictable = list(bm._free), list(bm._evictable)
    assert set(bm._free_order) >= bm._free, "a free block that is never handed out"
    holders: dict[int, int] = {}
    for seq in live:
        assert len(set(seq.block_table)) == len(seq.block_table), f"a block twice in one table {seq.block_table}"
        for block in seq.block_table:
            holders[block] = holders.get(block, 0) + 1
    free_s, evict_s, ref_s = set(free), set(evictable), set(holders)
    assert not free_s & evict_s, f"free and evictable: {free_s & evict_s}"
    assert not free_s & ref_s, f"free and referenced: {free_s & ref_s}"
    assert not evict_s & ref_s, f"evictable and referenced: {evict_s & ref_s}"
    assert free_s | evict_s | ref_s == set(range(bm.num_blocks)), "a block is nowhere (leaked)"
    for block in range(bm.num_blocks):
        if block in free_s:
            assert bm.refcount[block] == 0 and block not in bm._hash_of, f"free block {block}"
        elif block in evict_s:
            assert bm.refcount[block] == 0 and block in bm._hash_of, f"evictable block {block}"
        else:
            assert bm.refcount[block] == holders[block], \
                f"block {block}: refcount {bm.refcount[block]}, held by {holders[block]} tables"
    assert bm.num_free == len(free) + len(evictable)
    assert bm.num_free + len(holders) == bm.num_blocks
    assert bm.num_used == len(holders)
    # the prefix index is a bijection hash <-> registered block, with the tokens kept for the hit check
    assert set(bm._tokens_of) == set(bm._hash_of)
    assert {h: b for b, h in bm._hash_of.items()} == bm._block_of
    if not bm.prefix_caching:
        assert not bm._hash_of
    if pool is not None:
        for seq in live:
            pool.assert_holds(seq)
        for block, tokens in bm._tokens_of.items():  # a registered block holds exactly its registered tokens
            assert tuple(pool.slots[block][i] for i in range(bm.block_size)) == tokens


# ---------------------------------------------------------------------------------------------------
# construction, allocation


def test_rejects_an_empty_pool():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_allocate_grows_the_table_and_accounts_blocks():
    bm = BlockManager(8, 4)
    assert (bm.num_free, bm.num_used) == (8, 0)
    seq = KVSequence(list(range(10)))
    assert bm.blocks_needed(seq, 10) == 3
    bm.allocate(seq, 10)
    assert seq.block_table == [0, 1, 2]  # low ids first
    assert (bm.num_free, bm.num_used) == (5, 3)
    assert bm.refcount[:3] == [1, 1, 1]
    bm.allocate(seq, 12)  # still fits in 3 blocks
    assert seq.block_table == [0, 1, 2] and bm.num_used == 3
    bm.allocate(seq, 13)
    assert seq.block_table == [0, 1, 2, 3] and bm.num_used == 4
    assert bm.blocks_needed(seq, 5) == 0 and bm.blocks_needed(seq, 17) == 1
    assert bm.can_allocate(seq, 32) and not bm.can_allocate(seq, 33)  # 4 held + 4 free blocks of 4
    assert bm.can_allocate(seq, 16, reserve=4) and not bm.can_allocate(seq, 16, reserve=5)
    check_invariants(bm, [seq])


def test_allocate_is_all_or_nothing_with_a_clear_message():
    bm = BlockManager(4, 4)
    a = KVSequence(list(range(8)))
    bm.allocate(a, 8)
    b = KVSequence(list(range(20)))
    with pytest.raises(NoFreeBlocks, match=r"KV cache full: 5 blocks needed, 2 free of 4") as err:
        bm.allocate(b, 20)
    assert isinstance(err.value, EngineError)
    assert b.block_table == [] and bm.num_free == 2 and bm.refcount == [1, 1, 0, 0]
    bm.allocate(b, 8)  # what does fit still fits
    assert b.block_table == [2, 3] and bm.num_free == 0
    check_invariants(bm, [a, b])


# ---------------------------------------------------------------------------------------------------
# reference counts and sharing


def test_share_counts_references_and_release_frees_at_zero():
    bm = BlockManager(8, 4)
    pool = Pool(bm)
    a = KVSequence(list(range(10)))
    pool.compute(a)  # blocks 0, 1 full, 2 partial
    b = bm.share(a, 10)
    assert b.block_table == [0, 1, 2] and b.num_computed == b.num_cached == 10
    assert b.block_hashes == a.block_hashes[:2]
    assert bm.refcount[:3] == [2, 2, 2] and bm.num_used == 3  # no new block
    c = bm.share(a, 5)  # mid-block: blocks 0 and 1
    assert c.block_table == [0, 1] and c.tokens == list(range(5)) and c.block_hashes == a.block_hashes[:1]
    assert bm.refcount[:3] == [3, 3, 2]
    assert bm.share(a, 0).block_table == []
    with pytest.raises(ValueError):
        bm.share(a, 11)
    check_invariants(bm, [a, b, c], pool)

    bm.release(a)
    assert a.block_table == [] and a.num_computed == 0 and a.tokens == list(range(10))
    assert bm.refcount[:3] == [2, 2, 1] and bm.num_used == 3
    bm.release(b)
    assert bm.refcount[:3] == [1, 1, 0] and bm.num_used == 2  # block 2 back (partial: free, not cached)
    assert 2 in bm._free
    bm.release_blocks(c.block_table)
    assert bm.num_used == 0
    assert set(bm._evictable) == {0, 1}  # full registered blocks stay cached
    check_invariants(bm, [])


# ---------------------------------------------------------------------------------------------------
# copy-on-write


def test_writing_a_shared_partial_block_copies_it():
    bm = BlockManager(8, 4)
    pool = Pool(bm)
    a = KVSequence(list(range(6)))
    pool.compute(a)  # [0: full, 1: 2 of 4]
    snap = bm.share(a, 6)
    a.tokens += [100, 101]
    used = bm.num_used
    copies = pool.compute(a)
    assert copies == [(1, 2)]
    assert a.block_table == [0, 2] and snap.block_table == [0, 1]  # the other holder's table is unchanged
    assert bm.refcount[:3] == [2, 1, 1] and bm.num_used == used + 1
    pool.assert_holds(snap)  # its block 1 still holds tokens 4, 5 only
    assert pool.slots[1] == {0: 4, 1: 5}
    # the now private copy is written in place the next time
    a.tokens += [102]
    assert pool.compute(a) == []
    check_invariants(bm, [a, snap], pool)


def test_writing_a_private_unregistered_block_needs_no_copy():
    bm = BlockManager(4, 4)
    seq = KVSequence(list(range(3)))
    bm.allocate(seq, 3)
    assert bm.take_copies() == []
    seq.num_computed = 3
    bm.allocate(seq, 4)
    assert bm.take_copies() == []
    assert seq.block_table == [0]


def test_writing_a_block_registered_in_the_prefix_cache_copies_it():
    bm = BlockManager(8, 4)
    pool = Pool(bm)
    a = KVSequence(list(range(8)))
    pool.compute(a)
    assert set(bm._hash_of) == {0, 1}
    # the scheduler would never rewrite a computed block, but if it does the cached copy must survive
    assert bm.blocks_needed(a, 6, start=4) == 1
    bm.allocate(a, 6, start=4)
    copies = bm.take_copies()
    assert copies == [(1, 2)] and a.block_table == [0, 2]
    assert bm.refcount[1] == 0 and 1 in bm._evictable  # the cached original stays matchable
    b = new(bm, range(8), max_tokens=8)
    assert b.block_table == [0, 1] and b.num_cached == 8


def test_copy_on_write_without_a_free_block_raises():
    bm = BlockManager(2, 4)
    a = KVSequence(list(range(6)))
    Pool(bm).compute(a)
    snap = bm.share(a, 6)
    a.tokens.append(6)
    assert bm.blocks_needed(a, 7) == 1  # the shared partial block must be copied before the write
    assert not bm.can_allocate(a, 7)
    with pytest.raises(NoFreeBlocks, match="1 blocks needed, 0 free"):
        bm.allocate(a, 7)
    assert a.block_table == snap.block_table == [0, 1]  # unchanged
    check_invariants(bm, [a, snap])


# ---------------------------------------------------------------------------------------------------
# prefix cache


def test_commit_registers_full_blocks_only():
    bm = BlockManager(8, 4)
    pool = Pool(bm)
    a = KVSequence(list(range(11)))
    pool.compute(a, 3)
    assert a.block_hashes == [] and not bm._hash_of
    pool.compute(a, 9)
    assert len(a.block_hashes) == 2 and set(bm._hash_of) == {0, 1}
    assert bm._tokens_of == {0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}
    pool.compute(a, 11)
    assert len(a.block_hashes) == 2 and 2 not in bm._hash_of
    a.tokens += [11]
    pool.compute(a)
    assert len(a.block_hashes) == 3 and bm._tokens_of[2] == (8, 9, 10, 11)
    check_invariants(bm, [a], pool)


def test_a_duplicate_block_is_not_registered_twice():
    bm = BlockManager(8, 4)
    pool = Pool(bm)
    a, b = KVSequence(list(range(8))), KVSequence(list(range(8)))  # computed side by side, no cache hit
    pool.compute(a)
    pool.compute(b)
    assert a.block_hashes == b.block_hashes
    assert set(bm._hash_of) == {0, 1}  # b's blocks 2, 3 are private duplicates
    bm.release(b)
    assert sorted(bm._free)[:2] == [2, 3] and not bm._evictable
    check_invariants(bm, [a], pool)


def _cached(bm: BlockManager, pool: Pool, tokens) -> KVSequence:
    seq = KVSequence(list(tokens))
    pool.compute(seq)
    return seq


def test_match_prefix_finds_the_longest_chain_of_whole_blocks():
    bm = BlockManager(16, 4)
    pool = Pool(bm)
    a = _cached(bm, pool, range(14))  # 3 full blocks + 2 tokens
    # identical: only whole blocks, never the partial one
    b = new(bm, range(14))
    assert b.num_cached == b.num_computed == 12 and b.block_table == a.block_table[:3]
    assert b.block_hashes == a.block_hashes
    assert bm.refcount[:3] == [2, 2, 2]
    # differs inside the third block: two blocks
    c = new(bm, [*range(9), 99, 10, 11, 12])
    assert c.num_cached == 8 and c.block_table == [0, 1]
    # differs in the first block: nothing
    d = new(bm, [7, *range(1, 14)])
    assert d.num_cached == 0 and d.block_table == [] and d.block_hashes == []
    # max_tokens caps the match at whole blocks within it
    assert new(bm, range(14), max_tokens=11).num_cached == 8
    assert new(bm, range(14), max_tokens=3).num_cached == 0
    # a shorter prompt: whole blocks within it
    assert new(bm, range(7)).num_cached == 4
    with pytest.raises(ValueError):
        bm.match_prefix(b, 12)  # already has blocks


def test_a_matched_sequence_continues_correctly():
    bm = BlockManager(16, 4)
    pool = Pool(bm)
    a = _cached(bm, pool, range(10))
    b = new(bm, [*range(8), 50, 51, 52])
    assert b.num_cached == 8
    assert pool.compute(b) == []  # new tokens go into a fresh block
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] not in a.block_table
    check_invariants(bm, [a, b], pool)


def test_hits_and_queries_count_tokens():
    bm = BlockManager(16, 4)
    pool = Pool(bm)
    _cached(bm, pool, range(12))
    bm.hits = bm.queries = 0
    new(bm, range(10))       # 8 of 10
    new(bm, [5] * 6)         # 0 of 6
    new(bm, range(12), 11)   # 8 of 12 (capped by max_tokens)
    assert (bm.hits, bm.queries) == (16, 28)


def test_hashes_are_chained_over_the_whole_prefix():
    bm = BlockManager(16, 4)
    pool = Pool(bm)
    first = _cached(bm, pool, [1, 2, 3, 4, 5, 6, 7, 8])
    # block 2 has the same contents as the cached one, but after a different first block
    seq = new(bm, [9, 9, 9, 9, 5, 6, 7, 8, 0])
    assert seq.num_cached == 0
    # and computing it registers a block of its own for the same contents
    pool.compute(seq)
    assert bm._tokens_of[seq.block_table[1]] == (5, 6, 7, 8) and seq.block_table[1] != 1
    check_invariants(bm, [first, seq], pool)


def test_a_hash_collision_is_caught_by_the_token_check(monkeypatch):
    # the hash of a block ignores its contents: only its depth in the chain counts
    monkeypatch.setattr(BlockManager, "_chain", lambda self, prev, tokens: hash(("depth", prev)))
    bm = BlockManager(16, 4)
    pool = Pool(bm)
    bm.release(_cached(bm, pool, range(12)))
    bm.hits = bm.queries = 0
    same_first = new(bm, [0, 1, 2, 3, 40, 41, 42, 43, 8, 9, 10, 11, 12])
    assert same_first.num_cached == 4  # block 2 collides with a different cached block: stop there
    assert same_first.block_table == [0]
    other = new(bm, [50, 51, 52, 53, 4, 5, 6, 7])
    assert other.num_cached == 0 and other.block_table == []
    assert (bm.hits, bm.queries) == (4, 21)
    assert bm.refcount[:3] == [1, 0, 0]  # nothing was taken for the colliding blocks
    assert set(bm._evictable) == {1, 2}
    check_invariants(bm, [same_first, other], pool)


def test_prefix_caching_off_never_matches():
    bm = BlockManager(8, 4, prefix_caching=False)
    pool = Pool(bm)
    a = _cached(bm, pool, range(12))
    assert len(a.block_hashes) == 3 and not bm._hash_of
    b = new(bm, range(12))
    assert b.num_cached == 0 and b.block_table == [] and bm.hits == 0 and bm.queries == 12
    bm.release(a)
    assert bm.num_free == 8 and not bm._evictable
    check_invariants(bm, [b], pool)


def test_reset_prefix_cache_forgets_every_prefix():
    bm = BlockManager(8, 4)
    pool = Pool(bm)
    held = _cached(bm, pool, range(8))
    dropped = _cached(bm, pool, range(100, 108))
    bm.release(dropped)
    assert set(bm._evictable) == {2, 3}
    bm.reset_prefix_cache()
    assert not bm._evictable and not bm._hash_of and not bm._block_of and bm.num_free == 6
    assert new(bm, range(8)).num_cached == 0
    assert new(bm, range(100, 108)).num_cached == 0
    bm.release(held)  # no longer registered: straight back to the free list
    assert bm.num_free == 8 and not bm._evictable
    check_invariants(bm, [])


# ---------------------------------------------------------------------------------------------------
# eviction


def test_unreferenced_cached_blocks_stay_matchable_until_the_pool_runs_short():
    bm = BlockManager(6, 4)
    pool = Pool(bm)
    a = _cached(bm, pool, range(100, 108))     # blocks 0, 1
    b = _cached(bm, pool, range(200, 208))     # blocks 2, 3
    bm.release(a)
    bm.release(b)
    assert set(bm._evictable) == {0, 1, 2, 3} and bm.num_free == 6
    # two free blocks remain: taking them evicts nothing
    c = KVSequence(list(range(8)))
    bm.allocate(c, 8)
    assert c.block_table == [4, 5] and len(bm._evictable) == 4
    # the pool is short now: the least recently released blocks (a's) go first
    d = KVSequence(list(range(300, 308)))
    bm.allocate(d, 8)
    assert set(d.block_table) == {0, 1} and set(bm._evictable) == {2, 3}
    assert new(bm, range(100, 108)).num_cached == 0  # a's prefix is gone
    e = new(bm, range(200, 208))
    assert e.num_cached == 8 and e.block_table == [2, 3]  # b is still cached
    assert not bm._evictable
    check_invariants(bm, [c, d, e], pool)


def test_a_matched_block_is_revived_and_released_again_as_most_recent():
    bm = BlockManager(8, 4)
    pool = Pool(bm)
    for base in (100, 200, 300):   # blocks 0, 1, 2 released in this order
        bm.release(_cached(bm, pool, range(base, base + 4)))
    assert list(bm._evictable) == [0, 1, 2]
    hit = new(bm, range(100, 104))
    assert hit.block_table == [0] and bm.refcount[0] == 1 and 0 not in bm._evictable
    bm.release(hit)
    assert list(bm._evictable) == [1, 2, 0]  # used most recently now
    filler = KVSequence(list(range(24)))
    bm.allocate(filler, 24)   # 5 free + 1 evicted
    assert filler.block_table == [3, 4, 5, 6, 7, 1]
    assert list(bm._evictable) == [2, 0]
    bm.allocate(filler, 28)
    assert filler.block_table[-1] == 2 and list(bm._evictable) == [0]
    again = new(bm, range(100, 104))
    assert again.num_cached == 4 and not bm._evictable
    with pytest.raises(NoFreeBlocks):
        bm.allocate(filler, 32)
    check_invariants(bm, [filler, again], pool)


def test_eviction_unregisters_the_block():
    bm = BlockManager(2, 4)
    pool = Pool(bm)
    bm.release(_cached(bm, pool, range(8)))
    seq = KVSequence(list(range(50, 58)))
    pool.compute(seq)  # evicts both cached blocks and registers new contents in them
    assert new(bm, range(8)).num_cached == 0
    assert set(seq.block_table) == {0, 1}
    assert bm._tokens_of == {seq.block_table[0]: tuple(range(50, 54)), seq.block_table[1]: tuple(range(54, 58))}
    check_invariants(bm, [seq], pool)


# ---------------------------------------------------------------------------------------------------
# preemption, as the scheduler does it


def test_preempting_the_newest_sequence_frees_its_blocks_and_keeps_the_others():
    bm = BlockManager(10, 4)
    pool = Pool(bm)
    seqs = [KVSequence([s * 100 + i for i in range(n)]) for s, n in enumerate((10, 7, 9))]  # 3 + 2 + 3 blocks
    for seq in seqs:
        pool.compute(seq)
    tables = [list(s.block_table) for s in seqs]
    assert bm.num_free == 2
    # the oldest wants to grow by 3 blocks: the pool cannot, so the newest is preempted (recompute later)
    grow = seqs[0]
    grow.tokens += list(range(900, 914))  # 3 blocks -> 6
    with pytest.raises(NoFreeBlocks):
        pool.compute(grow)
    assert grow.block_table == tables[0] and grow.num_computed == 10
    victim = seqs.pop()
    bm.release(victim)
    assert victim.block_table == [] and victim.num_computed == 0 and victim.block_hashes == []
    assert bm.num_free == 5  # its 2 full blocks cached (evictable), its partial block free
    assert len(bm._evictable) == 2
    pool.compute(grow)
    assert grow.block_table[:3] == tables[0] and seqs[1].block_table == tables[1]
    check_invariants(bm, seqs, pool)
    # the victim is started again from nothing later, matching whatever of its prefix survived
    bm.release(seqs.pop())
    again = new(bm, victim.tokens, len(victim.tokens) - 1)
    assert again.num_cached in (0, 4, 8)
    pool.compute(again)
    check_invariants(bm, [grow, again], pool)


# ---------------------------------------------------------------------------------------------------
# randomized


def _random_run(rng: random.Random, prefix_caching: bool, steps: int, bs: int) -> dict[str, int]:
    """`steps` random operations (new / compute / decode / share / release / reset) on a random pool; the
    invariants are checked after each, and the pool is whole once every sequence is released."""
    bm = BlockManager(rng.randint(4, 24), bs, prefix_caching)
    pool = Pool(bm)
    # prompts from a few stems so that prefixes are shared often
    stems = [[rng.randrange(5) for _ in range(rng.randint(0, 12))] for _ in range(4)]
    live: list[KVSequence] = []
    counts = {"alloc_fail": 0, "hit": 0, "cow": 0, "evicted": 0}

    def grow(seq: KVSequence, extra: int) -> None:
        seq.tokens += [rng.randrange(5) for _ in range(extra)]

    for _ in range(steps):
        op = rng.choice(["new", "new", "compute", "compute", "decode", "decode", "share", "release", "reset"])
        if bm.num_free < 3 and rng.random() < 0.3:
            op = "release"
        if op == "new":
            seq = KVSequence(rng.choice(stems) + [rng.randrange(5) for _ in range(rng.randint(1, 8))])
            counts["hit"] += bm.match_prefix(seq, len(seq.tokens) - rng.choice([0, 1])) > 0
            live.append(seq)
        elif op in ("compute", "decode") and live:
            seq = rng.choice(live)
            grow(seq, 0 if op == "compute" and seq.num_pending else 1)
            end = rng.randint(seq.num_computed + 1, len(seq.tokens))
            before = (list(seq.block_table), list(bm.refcount), bm.num_free)
            cached = set(bm._evictable)
            # can_allocate (its decode fast path included) says exactly whether the allocation succeeds
            fits = bm.can_allocate(seq, end)
            assert fits == (bm.blocks_needed(seq, end) <= bm.num_free)
            try:
                counts["cow"] += bool(pool.compute(seq, end))
                counts["evicted"] += len(cached & set(seq.block_table) - set(before[0]))
                assert fits
            except NoFreeBlocks:
                assert not fits
                counts["alloc_fail"] += 1
                # allocate is all or nothing, copy-on-write included
                if len(seq.block_table) == len(before[0]):
                    assert (seq.block_table, bm.refcount, bm.num_free) == before
        elif op == "share" and live:
            seq = rng.choice(live)
            live.append(bm.share(seq, rng.randint(0, seq.num_computed)))
        elif op == "release" and live:
            bm.release(live.pop(rng.randrange(len(live))))
        elif op == "reset" and rng.random() < 0.2:
            bm.reset_prefix_cache()
        check_invariants(bm, live, pool)
    for seq in live:
        bm.release(seq)
    check_invariants(bm, [], pool)
    assert bm.num_free == bm.num_blocks
    return counts


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_random_operations_keep_the_invariants(seed, prefix_caching):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 3, 4]) if seed else 1  # block size 1: no partial blocks
    counts = _random_run(rng, prefix_caching, 500, bs)
    # the run exercised what it is meant to
    assert counts["alloc_fail"] > 0
    assert (counts["evicted"] > 0) == prefix_caching
    assert (counts["cow"] > 0) == (bs > 1)  # only a shared partial block is ever copied
    assert (counts["hit"] > 0) == prefix_caching


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rng=st.randoms(use_true_random=False), prefix_caching=st.booleans(), bs=st.sampled_from([1, 2, 3, 4]),
       steps=st.integers(1, 120))
def test_any_operation_sequence_keeps_the_invariants(rng, prefix_caching, bs, steps):
    """The same operations with hypothesis choosing them (and shrinking a failure to a short sequence)."""
    _random_run(rng, prefix_caching, steps, bs)


# ---------------------------------------------------------------------------------------------------
# speculative decoding: rolling rejected tokens back


def test_rollback_forgets_rejected_tokens_and_their_cache_entries():
    bm = BlockManager(8, 4)
    pool = Pool(bm)
    seq = new(bm, [1, 2, 3, 4, 5, 6])
    pool.compute(seq)
    seq.tokens += [7, 8, 9, 10, 11]  # the pending token 7, then drafts 8..11 verified in one pass
    pool.compute(seq)
    assert len(seq.block_hashes) == 2 and len(bm._hash_of) == 2  # [5, 6, 7, 8] was registered with draft 8
    bm.rollback(seq, 8)  # 7 and 8 accepted: the first two blocks stay valid, the third goes back
    assert (seq.tokens, seq.num_computed, len(seq.block_table), len(bm._hash_of)) == ([1, 2, 3, 4, 5, 6, 7, 8], 8, 2, 2)
    bm.rollback(seq, 7)  # 8 rejected after all: its block leaves the prefix cache
    assert (seq.num_computed, len(seq.block_table), len(seq.block_hashes), len(bm._hash_of)) == (7, 2, 1, 1)
    probe = KVSequence([1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert bm.match_prefix(probe, 9) == 4
    bm.release(probe)
    seq.tokens += [99]  # the target's own token where 8 was
    pool.compute(seq)
    check_invariants(bm, [seq], pool)
    with pytest.raises(ValueError):
        bm.rollback(seq, 9)


@pytest.mark.parametrize("seed", range(6))
def test_random_speculation_keeps_the_invariants(seed):
    """Sequences (some sharing prefixes) that draft, verify and roll back at random: a block registered while it
    held rejected tokens would hold other tokens once the real ones are written, which check_invariants catches."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 3, 4])
    bm = BlockManager(rng.randint(10, 24), bs)
    pool = Pool(bm)
    live: list[KVSequence] = []
    unregistered = 0
    for _ in range(300):
        op = rng.choice(["new", "speculate", "speculate", "speculate", "release"])
        if op == "new" or not live:
            seq = KVSequence([rng.randrange(3) for _ in range(rng.randint(1, 10))])
            bm.match_prefix(seq, len(seq.tokens) - 1)
            try:
                pool.compute(seq)
            except NoFreeBlocks:
                bm.release(seq)
                continue
            seq.tokens.append(rng.randrange(3))  # its first sampled token, pending
            live.append(seq)
        elif op == "speculate":
            seq = rng.choice(live)
            start, length = seq.num_computed, len(seq.tokens)
            seq.tokens += [rng.randrange(3) for _ in range(rng.randint(1, 5))]
            try:
                pool.compute(seq)
            except NoFreeBlocks:
                del seq.tokens[length:]
                continue
            registered = len(bm._hash_of)
            bm.rollback(seq, rng.randint(start + 1, len(seq.tokens)))
            unregistered += len(bm._hash_of) < registered
            seq.tokens.append(rng.randrange(3))  # the target's token after the accepted ones
        else:
            bm.release(live.pop(rng.randrange(len(live))))
        check_invariants(bm, live, pool)
    assert unregistered > 0
