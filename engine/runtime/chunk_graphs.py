"""`ChunkGraphs`: prompt chunks on a GPU as CUDA graphs, one captured per chunk-length bucket; `GraphStep`: a step
of decode rows and a few chunks run as graph replays only.

Eager steps are bound by the host on a GPU: a 128-token prefill of the 1B shape launches its kernels from Python
for longer than the GPU takes to run them (bench/RESULTS.md#issue-13-gpu-chunk-graphs), and under load a new
prompt arrives nearly every step, which turned every step of a busy server into an eager one. So a chunk of L
tokens (one row: a fresh prompt, or the next chunk of a long one over its cached blocks) replays the graph of the
smallest bucket >= L (16 ... 2048 tokens).
The graph is the model's own forward over a static buffer [ids | positions | slots | (0, L, end) | L - 1 | block
table], filled on the host in pinned memory and sent with one copy. Attention goes through the paged prefill kernel
(the chunk's own keys are written to the cache first), whose grid depends on the bucket only; padding tokens read
token 0 at position 0, write their keys to the pool's spare slot, and no row claims their queries.

Buckets of up to ALL_LOGITS_TOKENS tokens compute every position's logits (the LM head reads its weights once either
way), so that a speculative verification row (its drafts and last token), which needs them all, replays one too.

A step whose rows are decode rows (the decode graphs, engine/runtime/cuda_graphs.py) plus at most MAX_CHUNKS such chunks
runs as those replays, the logits put back in the rows' order; anything else runs eagerly.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from engine.model.batch import DENSE_MIN_ROWS, ForwardBatch, StepRow, TokenFeed
from engine.runtime.cuda_graphs import DecodeGraphs, bucket_of, capture_buckets, is_decode_row
from engine.cache.kv_cache import PagedKVCache
from engine.config import MAX_CHUNKS

log = logging.getLogger("emberserve.engine")

CHUNK_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)
ALL_LOGITS_TOKENS = 32
_HEAD = 3  # ids, positions, slots: one column of `tokens` each


def chunk_buckets(max_tokens: int) -> list[int]:
    """The buckets for chunks of up to `max_tokens` tokens (at most the largest of CHUNK_BUCKETS)."""
    return [b for b in CHUNK_BUCKETS if b < max_tokens] + [next((b for b in CHUNK_BUCKETS if b >= max_tokens),
                                                              CHUNK_BUCKETS[-1])]


class ChunkStaging:
    """The static inputs of one chunk bucket, as int32 in pinned host memory and on the device: a chunk is one copy."""

    def __init__(self, tokens: int, width: int, trash_slot: int, device: torch.device) -> None:
        self.tokens, self.width, self.trash_slot = tokens, width, trash_slot
        self.all_logits = tokens <= ALL_LOGITS_TOKENS  # every position's logits, not only the chunk's last
        self._logit_count = tokens if self.all_logits else 1
        size = _HEAD * tokens + 3 + self._logit_count + width
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.device = torch.zeros(size, dtype=torch.int32, device=device)
        self._np = self.host.numpy()
        t = tokens
        self._ids, self._pos, self._slots = (self._np[i * t:(i + 1) * t] for i in range(_HEAD))
        self._rows = self._np[_HEAD * t:_HEAD * t + 3]  # query start, query length, key count
        self._logit = self._np[_HEAD * t + 3:_HEAD * t + 3 + self._logit_count]
        self._logit[:] = range(self._logit_count)  # all positions: fixed
        self._table = self._np[_HEAD * t + 3 + self._logit_count:]
        # The host buffer is refilled only once its last copy has left (a bucket may serve two chunks of a step).
        self._sent = torch.cuda.Event() if device.type == "cuda" else None

    def fill(self, row: StepRow | None, block_size: int) -> None:
        """Write chunk `row` (tokens [start, end) of its sequence) into the host buffer; None: all padding."""
        if self._sent is not None:
            self._sent.synchronize()
        n = 0 if row is None else row.end - row.start
        if n > self.tokens:
            raise ValueError(f"a chunk of {n} tokens does not fit a bucket of {self.tokens}")
        self._ids[n:] = 0
        self._pos[n:] = 0
        self._slots[n:] = self.trash_slot
        if row is None:
            self._rows[:] = 0
            self._table[:] = 0
            if not self.all_logits:
                self._logit[0] = 0
            return
        seq, start, end, _ = row
        table = seq.block_table
        self._ids[:n] = seq.tokens[start:end]
        self._pos[:n] = range(start, end)
        self._slots[:n] = [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        self._rows[:] = (0, n, end)
        if not self.all_logits:
            self._logit[0] = n - 1
        blocks = -(-end // block_size)
        self._table[:blocks] = table[:blocks]
        self._table[blocks:] = table[0]  # a valid block, never read past the row's keys

    def pad(self, block_size: int) -> None:
        """All padding (what a capture runs over)."""
        self.fill(None, block_size)

    def upload(self) -> None:
        self.device.copy_(self.host, non_blocking=True)
        if self._sent is not None:
            self._sent.record()

    def batch(self, block_size: int) -> ForwardBatch:
        """The bucket's ForwardBatch over the device buffer: one row through the paged prefill kernel."""
        t, d = self.tokens, self.device
        ids, positions, slots = (d[i * t:(i + 1) * t] for i in range(_HEAD))
        rows = d[_HEAD * t:_HEAD * t + 3].view(3, 1)
        logit_index = d[_HEAD * t + 3:_HEAD * t + 3 + self._logit_count]
        table = d[_HEAD * t + 3 + self._logit_count:].view(1, self.width)
        # Short buckets take the packed kernels as an eager chunk that short would (batch.DENSE_MIN_ROWS).
        packed = t if t < DENSE_MIN_ROWS else 0
        return ForwardBatch(ids, positions, slots, logit_index, block_size, packed, False, 0, 0, 0, None, None,
                            None, None, None, [], [], [], [], [], rows, table, t)


class ChunkGraphs:
    """Captured chunk steps for buckets up to `max_tokens` tokens over one model and KV pool."""

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, max_tokens: int, table_width: int,
                 trash_slot: int) -> None:
        self.model, self.cache = model, cache
        self.buckets = chunk_buckets(max_tokens)
        self.block_size = cache.block_size
        device = cache.keys[0].device
        self._staging = {b: ChunkStaging(b, table_width, trash_slot, device) for b in self.buckets}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket's graph, largest first, in one memory pool of their own; returns the seconds."""
        started = time.perf_counter()
        self._graphs = capture_buckets(self.model, self.cache, self._staging, self.block_size)
        took = time.perf_counter() - started
        log.info("captured CUDA graphs for prompt chunks of %s tokens in %.1f s",
                 ", ".join(map(str, self.buckets)), took)
        return took

    def serves(self, row: StepRow) -> bool:
        """Whether chunk `row` replays a graph: within the largest bucket, and a bucket with every position's logits
        if it wants them."""
        bucket = bucket_of(row.end - row.start, self.buckets)
        return bool(self._graphs) and bucket is not None and (row.logits != "all" or self._staging[bucket].all_logits)

    def run(self, row: StepRow) -> torch.Tensor:
        """The chunk's logits: [1, vocab] after its last token, or [n, vocab] after each of its n ("all"); a view of
        the graph's output, valid until its next replay."""
        n = row.end - row.start
        staging = self._staging[bucket_of(n, self.buckets)]
        staging.fill(row, self.block_size)
        staging.upload()
        graph, logits = self._graphs[staging.tokens]
        graph.replay()
        if not staging.all_logits:
            return logits
        return logits[:n] if row.logits == "all" else logits[n - 1:n]


class GraphStep:
    """Runs a step of decode rows and up to MAX_CHUNKS prompt chunks as graph replays, or says it cannot."""

    def __init__(self, decode: DecodeGraphs, chunks: ChunkGraphs | None) -> None:
        self.decode, self.chunks = decode, chunks

    def serves(self, rows: Sequence[StepRow]) -> bool:
        if self.decode.serves(rows):
            return True
        chunks = [r for r in rows if not is_decode_row(r)]
        decoding = len(rows) - len(chunks)
        return (self.chunks is not None and 0 < len(chunks) <= MAX_CHUNKS and decoding <= self.decode.max_batch
                and all(self.chunks.serves(r) for r in chunks))

    def run(self, rows: Sequence[StepRow], feed: TokenFeed | None = None) -> torch.Tensor:
        """Float32 logits for the rows' "last" positions (every position of an "all" row) in the rows' order, as an
        eager step returns them; `feed`: decode rows whose token is read on the device."""
        if self.decode.serves(rows):
            return self.decode.run(rows, feed)
        decode_rows = [r for r in rows if is_decode_row(r)]
        decode_feed = None
        if feed is not None:
            if any(s >= 0 and not is_decode_row(r) for r, s in zip(rows, feed.sources)):
                raise ValueError("only a decode row's token can be fed from the device")
            sources = [s for r, s in zip(rows, feed.sources) if is_decode_row(r)]
            decode_feed = TokenFeed(feed.tokens, sources) if any(s >= 0 for s in sources) else None
        pieces = [self.decode.run(decode_rows, decode_feed)] if decode_rows else []
        # Each row's first row among the pieces joined, and how many it has.
        place = {id(r): (i, 1) for i, r in enumerate(decode_rows)}
        joined = len(decode_rows)
        chunks = [r for r in rows if not is_decode_row(r)]
        buckets = [bucket_of(r.end - r.start, self.chunks.buckets) for r in chunks]
        logits = None
        for i, row in enumerate(chunks):
            logits = self.chunks.run(row)
            if row.logits != "none":
                # a later chunk of the same bucket replays its graph again, overwriting this output
                pieces.append(logits.clone() if buckets[i] in buckets[i + 1:] else logits)
                place[id(row)] = (joined, len(logits))
                joined += len(logits)
        if not pieces:
            return logits.new_empty((0, logits.shape[1]))
        order = [j for row in rows if id(row) in place
                 for j in range(place[id(row)][0], place[id(row)][0] + place[id(row)][1])]
        out = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        if order != list(range(len(order))):
            out = out.index_select(0, torch.tensor(order, device=out.device))
        return out


__all__ = ["ALL_LOGITS_TOKENS", "CHUNK_BUCKETS", "MAX_CHUNKS", "ChunkGraphs", "ChunkStaging", "GraphStep", "chunk_buckets"]
