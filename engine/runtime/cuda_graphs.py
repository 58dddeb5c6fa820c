"""`DecodeGraphs`: pure decode steps on a GPU as CUDA graphs, one captured per batch-size bucket.

A decode step of B rows replays the graph of the smallest bucket >= B (1, 2, 4, ..., 256; O(log N) graphs, at most
2x padding). The graph was captured over static inputs: per bucket one int32 buffer holding the rows' token ids,
positions, cache slots, key counts, feed sources (TokenFeed) and block tables, filled on the host in pinned memory
and sent with one copy per step. Padding rows read token 0 at position 0, write their key and value to a slot no sequence owns (the pool's
spare block) and have no keys, so the paged decode kernel skips them; their logits are dropped. The graph runs the
same modules as every other step (engine/model/decoder.py): the model's forward, captured.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from engine.model.batch import ForwardBatch, StepRow, TokenFeed
from engine.cache.kv_cache import PagedKVCache

log = logging.getLogger("emberserve.engine")

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_INPUTS = 4  # ids, positions, slots, key counts: the graph's inputs
_COLUMNS = 5  # those and the feed sources (read before the replay); then the block table


def buckets_for(max_batch: int) -> list[int]:
    """The buckets that serve every decode step of up to `max_batch` rows: powers of two, the last >= max_batch."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    out = [b for b in BUCKETS if b < max_batch]
    out.append(next((b for b in BUCKETS if b >= max_batch), max_batch))
    return out


def is_decode_row(row: StepRow) -> bool:
    """A row the decode graphs take: one new token, its next-token logits."""
    return row.end - row.start == 1 and row.logits == "last"


def bucket_of(rows: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding `rows`, or None when none does."""
    return next((b for b in buckets if b >= rows), None)


class StepStaging:
    """The static inputs of one bucket: [ids | positions | slots | key counts | feed sources | tables (rows x
    width)] as int32, in pinned host memory and on the device, so that a step is one host-to-device copy."""

    def __init__(self, rows: int, width: int, trash_slot: int, device: torch.device) -> None:
        self.rows, self.width, self.trash_slot = rows, width, trash_slot
        size = rows * (_COLUMNS + width)
        pin = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=pin)
        self.device = torch.zeros(size, dtype=torch.int32, device=device)
        self._np = self.host.numpy()
        r = rows
        self._ids, self._pos, self._slots, self._lens, self._sources = (self._np[i * r:(i + 1) * r]
                                                                        for i in range(_COLUMNS))
        self._tables = self._np[_COLUMNS * r:].reshape(r, width)

    def fill(self, rows: Sequence[StepRow], block_size: int, sources: Sequence[int] | None = None) -> None:
        """Write decode `rows` (one new token each) into the host buffer; the rest of the bucket is padding.
        `sources`: a TokenFeed's that `feed_ids` reads after the upload (None where the feed is an identity)."""
        n = len(rows)
        if n > self.rows:
            raise ValueError(f"{n} rows do not fit a bucket of {self.rows}")
        # Whole columns at once: one numpy assignment each rather than a scalar store per row; what numpy can
        # work out from the columns (the slots, from the tables) it does, not a Python loop over the rows.
        if n:
            seqs, positions, ends, _ = zip(*rows)
            self._ids[:n] = [seq.tokens[p] for seq, p in zip(seqs, positions)]
            self._pos[:n] = positions
            self._lens[:n] = ends
            tables = self._tables
            for i, seq, end in zip(range(n), seqs, ends):
                table, blocks = seq.block_table, -(-end // block_size)
                tables[i, :blocks] = table if len(table) == blocks else table[:blocks]  # no copy where it can
            pos = self._pos[:n]
            self._slots[:n] = tables[np.arange(n), pos // block_size] * block_size + pos % block_size
        self._ids[n:] = 0
        self._pos[n:] = 0
        self._slots[n:] = self.trash_slot
        self._lens[n:] = 0
        if sources is not None:
            self._sources[:n] = sources
            self._sources[n:] = -1

    def pad(self, block_size: int) -> None:
        """Every row padding (what a capture runs over)."""
        self.fill([], block_size)

    def upload(self) -> None:
        self.device.copy_(self.host, non_blocking=True)

    def feed_ids(self, feed: TokenFeed, identity: bool) -> None:
        """The fed rows' token ids from `feed.tokens`, on the device (after `fill` and `upload`); `identity`:
        `feed.is_identity(rows)`, else `fill` was given its sources."""
        n = len(feed.sources)
        ids = self.device[:n]
        if identity:  # the common step: the same rows as the step that sampled them
            ids.copy_(feed.tokens[:n])
            return
        r = self.rows
        sources = self.device[_INPUTS * r:_INPUTS * r + n]
        fed = feed.tokens.index_select(0, sources.clamp(min=0)).to(ids.dtype)
        ids.copy_(torch.where(sources >= 0, fed, ids))

    def batch(self, block_size: int) -> ForwardBatch:
        """The bucket's ForwardBatch over the device buffer (built inside a capture: its casts are replayed)."""
        r, d = self.rows, self.device
        ids, positions, slots, lens = (d[i * r:(i + 1) * r] for i in range(_INPUTS))
        tables = d[_COLUMNS * r:].view(r, self.width)
        return ForwardBatch(
            ids, positions, slots, torch.arange(r, device=d.device), block_size, r, False, r, 0, 0, None, None,
            None, tables, lens, [], [], [], [], [], None, None, 0)


class DecodeGraphs:
    """Captured decode steps for buckets up to `max_batch` rows over one model and KV pool."""

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, max_batch: int, table_width: int,
                 trash_slot: int) -> None:
        self.model, self.cache = model, cache
        self.buckets = buckets_for(max_batch)
        self.block_size = cache.block_size
        device = cache.keys[0].device
        self._staging = {b: StepStaging(b, table_width, trash_slot, device) for b in self.buckets}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket's graph, largest first (they share one memory pool); returns the seconds it took."""
        started = time.perf_counter()
        self._graphs = capture_buckets(self.model, self.cache, self._staging, self.block_size)
        took = time.perf_counter() - started
        log.info("captured CUDA graphs for decode batches of %s rows in %.1f s",
                 ", ".join(map(str, self.buckets)), took)
        return took

    def serves(self, rows: Sequence[StepRow]) -> bool:
        """Whether a step of `rows` replays a graph: decode rows only ("last" logits), within the largest bucket."""
        return (bool(self._graphs) and len(rows) <= self.max_batch
                and all(map(is_decode_row, rows)))

    def run(self, rows: Sequence[StepRow], feed: TokenFeed | None = None) -> torch.Tensor:
        """Logits [len(rows), vocab] of a decode step (a view of the graph's output, valid until the next replay);
        `feed`: rows whose token is read on the device."""
        bucket = bucket_of(len(rows), self.buckets)
        staging = self._staging[bucket]
        identity = feed is not None and feed.is_identity(len(rows))
        staging.fill(rows, self.block_size, None if feed is None or identity else feed.sources)
        staging.upload()
        if feed is not None:
            staging.feed_ids(feed, identity)
        graph, logits = self._graphs[bucket]
        graph.replay()
        return logits[:len(rows)]


def capture_buckets(model: torch.nn.Module, cache: PagedKVCache, stagings: dict[int, Any],
                    block_size: int) -> dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]]:
    """The model's forward over each staging's static batch (all padding while captured), captured as a CUDA graph,
    largest bucket first, the graphs sharing one memory pool: {bucket: (graph, its logits)}."""
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
    pool = None
    for bucket in sorted(stagings, reverse=True):
        staging = stagings[bucket]
        staging.pad(block_size)
        staging.upload()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: Triton compiles, cuBLAS picks its kernels
            for _ in range(2):
                model(staging.batch(block_size), cache)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = model(staging.batch(block_size), cache)
        pool = graph.pool()
        graphs[bucket] = (graph, logits)
    torch.cuda.synchronize()
    return graphs


def table_width(context_size: int, block_size: int) -> int:
    """Blocks a sequence of the whole context holds: the static width of a bucket's block tables."""
    return -(-context_size // block_size)


__all__ = ["BUCKETS", "DecodeGraphs", "StepStaging", "bucket_of", "buckets_for", "capture_buckets", "is_decode_row",
           "table_width"]
