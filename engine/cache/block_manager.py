"""`BlockManager`: the paged KV cache's bookkeeping: fixed-size blocks, reference counts, prefix hashing, LRU eviction.

A sequence's keys and values live in blocks of `block_size` tokens listed in its block table. Blocks are shared
by reference count (session snapshots, prompts with a common prefix); a full block is registered in the prefix
cache under a hash chained over all the tokens before it, so a later sequence with the same prefix reuses it.
Unreferenced registered blocks stay cached until the pool runs short, then are evicted least recently used first.

Its owner is the Runner (engine/runtime/runner.py): servers allocate, share and free blocks through the Runner's
methods, and read this manager's counts only.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.errors import EngineError


# A token that holds its place in a sequence while it is still being sampled on the device (async scheduling: the
# next step is scheduled, and reads it from the device, before the host has it). A block holding one is not
# registered in the prefix cache until the token is known.
PENDING_TOKEN = -1


class NoFreeBlocks(EngineError):
    """The KV pool cannot hold what was asked for, even after evicting every unreferenced cached block."""


@dataclass
class KVSequence:
    """One sequence's place in the paged cache: its tokens, its block table, and how much of it is computed."""

    tokens: list[int]
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0   # leading tokens whose keys/values are in the cache
    num_cached: int = 0     # of those, how many came from the prefix cache when the sequence started
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of its leading full blocks

    @property
    def num_pending(self) -> int:
        """Tokens whose keys/values are still to be computed."""
        return len(self.tokens) - self.num_computed


class BlockManager:
    """Allocates the blocks of a fixed pool to sequences; not thread-safe (one worker thread owns it)."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.refcount = [0] * num_blocks
        # Free blocks: a set for O(1) membership and a stack for the order they are handed out in (low ids first at
        # the start, then the most recently freed). A block taken out of turn (`_take(after)`) stays on the stack
        # as a stale entry, skipped when it comes up; the stack is rebuilt when stale entries dominate.
        self._free: set[int] = set(range(num_blocks))
        self._free_order: list[int] = list(range(num_blocks - 1, -1, -1))
        self._copies: list[tuple[int, int]] = []                     # copy-on-write (source, copy) to perform
        self._evictable: OrderedDict[int, None] = OrderedDict()      # cached, unreferenced; oldest first
        self._hash_of: dict[int, int] = {}                           # block → its prefix hash
        self._tokens_of: dict[int, tuple[int, ...]] = {}             # block → the tokens it holds (hit check)
        self._block_of: dict[int, int] = {}                          # prefix hash → block
        self.hits = self.queries = 0                                 # prefix-cache tokens found / looked up

    # ---- capacity ----
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free or evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def _shared(self, block: int) -> bool:
        """Whether writing into `block` must first copy it: other holders, or registered in the prefix cache."""
        return self.refcount[block] > 1 or block in self._hash_of

    def blocks_needed(self, seq: KVSequence, total_tokens: int, start: int | None = None) -> int:
        """Blocks `seq` takes to hold `total_tokens` tokens when it writes from `start` (default: its computed
        length): new table entries, plus a private copy of every shared block the write lands in."""
        bs, table = self.block_size, seq.block_table
        first = (seq.num_computed if start is None else start) // bs
        copies = sum(self._shared(table[i]) for i in range(first, min(len(table), -(-total_tokens // bs))))
        return max(0, -(-total_tokens // bs) - len(table)) + copies

    def can_allocate(self, seq: KVSequence, total_tokens: int, reserve: int = 0) -> bool:
        table, bs = seq.block_table, self.block_size
        first = seq.num_computed // bs
        # The common decode step takes nothing: the write lands in one private block the sequence holds (not
        # `_shared`, inlined, as is `num_free`: this runs for every row of every step).
        if first == (total_tokens - 1) // bs and first < len(table):
            block = table[first]
            if self.refcount[block] <= 1 and block not in self._hash_of:
                return reserve <= len(self._free) + len(self._evictable)
        return self.blocks_needed(seq, total_tokens) + reserve <= self.num_free

    def _pop_free(self) -> int:
        while True:
            block = self._free_order.pop()
            if block in self._free:
                self._free.discard(block)
                return block

    def _push_free(self, block: int) -> None:
        self._free.add(block)
        self._free_order.append(block)
        if len(self._free_order) > 2 * self.num_blocks:  # mostly stale entries: keep the live ones, in order
            seen: set[int] = set()
            order = [b for b in reversed(self._free_order) if b in self._free and not (b in seen or seen.add(b))]
            self._free_order = order[::-1]

    def _take(self, after: int | None = None) -> int:
        """A free block; the one right after block `after` if that one is free, so that a sequence's keys tend to
        stay one run of slots, which attention then reads in place instead of gathering (see batch.py)."""
        nxt = None if after is None else after + 1
        if nxt is not None and nxt in self._free:
            self._free.discard(nxt)  # its stack entry goes stale
            block = nxt
        elif self._free:
            block = self._pop_free()
        else:
            block, _ = self._evictable.popitem(last=False)
            self._unregister(block)
        self.refcount[block] = 1
        return block

    def allocate(self, seq: KVSequence, total_tokens: int, start: int | None = None) -> None:
        """Make `seq` ready to write tokens [start, total_tokens) (start: its computed length by default): grow its
        block table, and move it to a private copy of each shared block the write lands in (copy-on-write; the
        pairs wait in `take_copies` for the cache to copy). All or nothing."""
        bs, table = self.block_size, seq.block_table
        first = (seq.num_computed if start is None else start) // bs
        if first == (total_tokens - 1) // bs and first < len(table):  # as in `can_allocate`: the decode step
            block = table[first]
            if self.refcount[block] <= 1 and block not in self._hash_of:
                return
        need = self.blocks_needed(seq, total_tokens, start)
        if need > self.num_free:
            raise NoFreeBlocks(f"KV cache full: {need} blocks needed, {self.num_free} free of {self.num_blocks}")
        for i in range(first, min(len(table), -(-total_tokens // bs))):
            block = table[i]
            if self._shared(block):
                fresh = self._take(table[i - 1] if i else None)
                self._copies.append((block, fresh))
                self._decref(block)
                table[i] = fresh
        while len(table) < -(-total_tokens // bs):
            table.append(self._take(table[-1] if table else None))

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write (source, copy) block pairs allocated since the last call; the caller copies them."""
        copies, self._copies = self._copies, []
        return copies

    def _decref(self, block: int) -> None:
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._push_free(block)

    def release(self, seq: KVSequence) -> None:
        """Give back every block of `seq`; it keeps its tokens and can be started again from nothing."""
        # Last block first: eviction then takes a chain's tail before its head, keeping the prefix matchable.
        if self._copies:  # copies into blocks given back now must not land on their next holder
            gone = set(seq.block_table)
            self._copies = [(src, dst) for src, dst in self._copies if dst not in gone]
        for block in reversed(seq.block_table):
            self._decref(block)
        seq.block_table, seq.block_hashes, seq.num_computed = [], [], 0

    def rollback(self, seq: KVSequence, length: int) -> None:
        """Cut `seq` back to its first `length` tokens, all computed (speculative tokens the target rejected): the
        tokens after them, their blocks past the new end and their prefix-cache entries go. A block registered
        while it held rejected tokens would otherwise serve other prompts keys that are about to be overwritten."""
        if not 0 <= length <= seq.num_computed:
            raise ValueError(f"cannot roll a sequence of {seq.num_computed} computed tokens back to {length}")
        bs = self.block_size
        keep = length // bs  # full blocks wholly before the cut: their tokens, hashes and entries stay valid
        for i in range(keep, len(seq.block_hashes)):
            block = seq.block_table[i]
            # Written by this sequence since the last cut (a shared block is copied before any write), so an entry
            # under its hash is the one its own commit made.
            if self.refcount[block] == 1 and self._hash_of.get(block) == seq.block_hashes[i]:
                self._unregister(block)
        del seq.block_hashes[keep:]
        needed = -(-length // bs)
        if self._copies and len(seq.block_table) > needed:
            gone = set(seq.block_table[needed:])
            self._copies = [(src, dst) for src, dst in self._copies if dst not in gone]
        for block in reversed(seq.block_table[needed:]):
            self._decref(block)
        del seq.block_table[needed:]
        del seq.tokens[length:]
        seq.num_computed = length

    def release_blocks(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self._decref(block)

    def share(self, seq: KVSequence, length: int) -> KVSequence:
        """A new sequence holding the first `length` computed tokens of `seq`, sharing its blocks (no copy)."""
        if length > seq.num_computed:
            raise ValueError(f"cannot share {length} tokens of a sequence with {seq.num_computed} computed")
        blocks = seq.block_table[:-(-length // self.block_size)] if length else []
        for block in blocks:
            self.refcount[block] += 1
        full = length // self.block_size
        return KVSequence(list(seq.tokens[:length]), list(blocks), length, length, seq.block_hashes[:full])

    # ---- prefix cache ----
    def _chain(self, prev: int | None, tokens: tuple[int, ...]) -> int:
        # A cryptographic hash: Python's hash() of int tuples is the same in every process, so a crafted prompt
        # could collide with another user's chain and be served their keys and values.
        digest = hashlib.blake2b(array("q", tokens).tobytes(), digest_size=16,
                                 key=(prev or 0).to_bytes(16, "little")).digest()
        return int.from_bytes(digest, "little")

    def _unregister(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        self._tokens_of.pop(block, None)
        if h is not None and self._block_of.get(h) == block:
            del self._block_of[h]

    def commit(self, seq: KVSequence) -> None:
        """Register the sequence's newly completed full blocks in the prefix cache."""
        bs = self.block_size
        while len(seq.block_hashes) < seq.num_computed // bs:
            i = len(seq.block_hashes)
            tokens = tuple(seq.tokens[i * bs:(i + 1) * bs])
            if PENDING_TOKEN in tokens:  # registered by a later commit, once the token is known
                return
            h = self._chain(seq.block_hashes[-1] if seq.block_hashes else None, tokens)
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            if self.prefix_caching and h not in self._block_of and block not in self._hash_of:
                self._block_of[h], self._hash_of[block], self._tokens_of[block] = block, h, tokens

    def match_prefix(self, seq: KVSequence, max_tokens: int) -> int:
        """Attach the longest cached prefix (whole blocks, at most `max_tokens` tokens) to an empty `seq`."""
        if seq.block_table:
            raise ValueError("match_prefix needs a sequence without blocks")
        bs, prev, found = self.block_size, None, 0
        if self.prefix_caching:
            for i in range(min(max_tokens, len(seq.tokens)) // bs):
                tokens = tuple(seq.tokens[i * bs:(i + 1) * bs])
                h = self._chain(prev, tokens)
                block = self._block_of.get(h)
                if block is None or self._tokens_of[block] != tokens:  # a miss, or a hash collision
                    break
                if self.refcount[block] == 0:
                    del self._evictable[block]
                self.refcount[block] += 1
                seq.block_table.append(block)
                seq.block_hashes.append(h)
                prev, found = h, found + bs
        self.queries += len(seq.tokens)
        self.hits += found
        seq.num_computed = seq.num_cached = found
        return found

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (unreferenced cached blocks become free)."""
        for block in list(self._hash_of):
            self._unregister(block)
        while self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._push_free(block)
