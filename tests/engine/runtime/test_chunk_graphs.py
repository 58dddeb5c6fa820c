"""What CUDA-graph prompt chunks (engine/runtime/chunk_graphs.py) are made of, checked on CPU: the buckets, the static inputs
a chunk is filled with (which must give the chunk the logits and cache contents an ordinary step gives it, the
padding writing only the spare slot), and how a step of decode rows and chunks puts the logits back in the rows'
order. The capture and replay themselves run in tests/gpu/test_engine_cuda.py."""
from __future__ import annotations

import pytest
import torch

from engine import load_runner
from engine.model.batch import StepRow, TokenFeed
from engine.cache.block_manager import KVSequence
from engine.runtime.chunk_graphs import (ALL_LOGITS_TOKENS, CHUNK_BUCKETS, MAX_CHUNKS, ChunkStaging, GraphStep,
    chunk_buckets)
from engine.runtime.cuda_graphs import bucket_of, table_width
from engine.cache.kv_cache import PagedKVCache
from tests.support.tiny_models import prompt_ids


def test_chunk_buckets_double_up_to_the_longest_chunk() -> None:
    assert chunk_buckets(2048) == list(CHUNK_BUCKETS)
    assert chunk_buckets(100) == [16, 32, 64, 128]
    assert chunk_buckets(16) == [16]
    assert chunk_buckets(10 ** 6)[-1] == CHUNK_BUCKETS[-1]
    for n in range(2, 2049):
        bucket = bucket_of(n, CHUNK_BUCKETS)
        assert n <= bucket and (bucket == 16 or bucket < 2 * n)


def _spare_copy(runner) -> PagedKVCache:
    """The runner's cache contents in a pool with one spare block past the manager's, as on a GPU."""
    bs = runner.blocks.block_size
    cache = PagedKVCache(runner.config, runner.blocks.num_blocks + 1, bs, runner.dtype, runner.device)
    for i in range(runner.config.num_layers):
        cache.keys[i][:, :runner.cache.keys[i].shape[1]] = runner.cache.keys[i]
        cache.values[i][:, :runner.cache.values[i].shape[1]] = runner.cache.values[i]
    return cache


@pytest.mark.parametrize("variant", ["llama_tied", "gemma3"])
@pytest.mark.parametrize("cached", [0, 19])
@pytest.mark.parametrize("tokens,bucket,logits", [(21, 32, "last"), (21, 32, "all"), (40, 64, "last")])
def test_a_filled_chunk_bucket_gives_the_chunk_its_logits(tiny_zoo, variant, cached, tokens, bucket, logits) -> None:
    """A chunk in its bucket (a fresh prompt, or after 19 cached tokens: past gemma3's window), through the paged
    prefill path, against the ordinary CPU step: the next-token logits, or every position's from a bucket of at
    most ALL_LOGITS_TOKENS (what a speculative verification row needs); its keys where they belong, the padding's
    in the spare block only."""
    tiny = tiny_zoo.model(variant)
    runner = load_runner(str(tiny.safetensors_dir), dtype="float32")
    bs = runner.blocks.block_size
    seq = runner.new_sequence(prompt_ids(tiny, 0, cached + tokens), use_prefix_cache=False)
    if cached:
        runner.step([StepRow(seq, 0, cached, "none")])
    row = StepRow(seq, cached, cached + tokens, logits)
    runner.blocks.allocate(seq, row.end)
    cache = _spare_copy(runner)
    staging = ChunkStaging(bucket, table_width(runner.context_size, bs), runner.blocks.num_blocks * bs,
                           runner.device)
    assert staging.all_logits == (bucket <= ALL_LOGITS_TOKENS)
    staging.fill(row, bs)
    staging.upload()
    with torch.inference_mode():
        graphed = runner.model(staging.batch(bs), cache)
    if staging.all_logits:  # every position's, padding included: what ChunkGraphs.run cuts down
        assert graphed.shape == (bucket, runner.vocab_size)
        graphed = graphed[:tokens] if logits == "all" else graphed[tokens - 1:tokens]
    expected = runner.step([row])
    assert graphed.shape == expected.shape == (tokens if logits == "all" else 1, runner.vocab_size)
    assert torch.allclose(graphed, expected, atol=1e-4, rtol=1e-4), float((graphed - expected).abs().max())
    used = runner.blocks.num_blocks * bs
    for i in range(runner.config.num_layers):
        assert torch.allclose(cache.keys[i][:, :used], runner.cache.keys[i], atol=1e-5)
        assert torch.allclose(cache.values[i][:, :used], runner.cache.values[i], atol=1e-5)
    # The padding tokens' keys went to the spare block. (Past the first layer they are whatever the unclaimed
    # attention outputs held: never read, as no row's table holds that block.)
    assert cache.keys[0][:, used:].abs().sum() > 0


def test_a_chunk_longer_than_its_bucket_is_refused() -> None:
    staging = ChunkStaging(16, 4, 0, torch.device("cpu"))
    seq = KVSequence(list(range(20)))
    seq.block_table = [0, 1]
    with pytest.raises(ValueError, match="does not fit"):
        staging.fill(StepRow(seq, 0, 17), 16)


class _Decode:
    """A stand-in for DecodeGraphs: row i of a step's logits is 1000 * its token."""

    max_batch = 4

    def serves(self, rows) -> bool:
        return bool(rows) and all(r.end - r.start == 1 and r.logits == "last" for r in rows)

    def run(self, rows, feed=None) -> torch.Tensor:
        """A fed row's token is feed.tokens[its source] (engine.model.batch.TokenFeed)."""
        tokens = [r.seq.tokens[r.start] if feed is None or feed.sources[i] < 0 else int(feed.tokens[feed.sources[i]])
                  for i, r in enumerate(rows)]
        return torch.tensor([[1000.0 * t] * 3 for t in tokens])


class _Chunks:
    """A stand-in for ChunkGraphs: one output tensor per bucket, overwritten by each replay (as a graph's is); row j
    of a chunk's logits is its token j; bucket 16 has every position's logits, bucket 32 the last one's."""

    buckets = [16, 32]

    def __init__(self) -> None:
        self.outputs = {16: torch.zeros(16, 3), 32: torch.zeros(1, 3)}
        self.replays = 0

    def serves(self, row) -> bool:
        return row.end - row.start <= (16 if row.logits == "all" else 32)

    def run(self, row) -> torch.Tensor:
        self.replays += 1
        n = row.end - row.start
        out = self.outputs[bucket_of(n, self.buckets)]
        if len(out) == 1:
            out.fill_(float(row.seq.tokens[row.end - 1]))
            return out
        out[:n] = torch.tensor(row.seq.tokens[row.start:row.end], dtype=out.dtype)[:, None]
        return out[:n] if row.logits == "all" else out[n - 1:n]


def _row(token: int, start: int, end: int, logits: str = "last") -> StepRow:
    seq = KVSequence([0] * start + [token] * (end - start))
    return StepRow(seq, start, end, logits)


def _drafted(tokens: list[int], start: int) -> StepRow:
    """A verification row: the last token and drafts after `start` cached ones, every position's logits."""
    return StepRow(KVSequence([0] * start + tokens), start, start + len(tokens), "all")


def test_a_graph_step_returns_the_logits_in_the_rows_order() -> None:
    chunks = _Chunks()
    step = GraphStep(_Decode(), chunks)
    rows = [_row(5, 10, 20), _row(1, 3, 4), _drafted([8, 9, 4], 30), _row(7, 0, 12, "none"), _row(6, 0, 14),
            _row(2, 8, 9)]
    assert step.serves(rows)
    logits = step.run(rows)
    # the 10-token chunk, the 3-token verification row and the 14-token chunk share bucket 16: the first two's
    # logits survive the later replays
    assert logits[:, 0].tolist() == [5.0, 1000.0, 8.0, 9.0, 4.0, 6.0, 2000.0]
    assert chunks.replays == 4
    assert step.run([_drafted([3, 1], 5), _row(2, 8, 9)])[:, 0].tolist() == [3.0, 1.0, 2000.0]
    only_chunks = step.run([_row(3, 0, 20, "none"), _row(4, 0, 5)])
    assert only_chunks[:, 0].tolist() == [4.0]
    assert step.run([_row(3, 0, 20, "none")]).shape == (0, 3)


def test_a_graph_step_feeds_its_decode_rows_only() -> None:
    """A TokenFeed over a step's rows reaches the decode rows' graph with each decode row's own source (the chunks
    between them left out); a fed chunk is refused."""
    step = GraphStep(_Decode(), _Chunks())
    rows = [_row(5, 10, 20), _row(1, 3, 4), _row(6, 0, 14), _row(2, 8, 9), _row(4, 2, 3)]
    feed = TokenFeed(torch.tensor([7, 8, 9]), [-1, 2, -1, -1, 0])
    assert step.run(rows, feed)[:, 0].tolist() == [5.0, 9000.0, 6.0, 2000.0, 7000.0]
    assert step.run(rows[1:2], TokenFeed(torch.tensor([3]), [0]))[:, 0].tolist() == [3000.0]  # decode rows only
    with pytest.raises(ValueError, match="decode row"):
        step.run(rows, TokenFeed(torch.tensor([7]), [0, -1, -1, -1, -1]))


def test_a_graph_step_leaves_other_steps_to_the_eager_path() -> None:
    step = GraphStep(_Decode(), _Chunks())
    assert step.serves([_row(1, 3, 4)])
    assert not step.serves([_row(1, 0, 33)])  # past the longest bucket
    assert step.serves([_row(1, 0, 8, "all")])  # every position's logits: from a bucket that has them
    assert not step.serves([_row(1, 0, 20, "all")])  # from one that does not
    assert not step.serves([_row(1, 0, 8)] * (MAX_CHUNKS + 1))
    assert not step.serves([_row(1, 3, 4)] * 5 + [_row(1, 0, 8)])  # more decode rows than the largest bucket
    assert not GraphStep(_Decode(), None).serves([_row(1, 0, 8)])


def test_a_padded_chunk_bucket_claims_no_query() -> None:
    """What a capture runs over: every token padding (token 0 at position 0 into the spare slot), no query claimed."""
    staging = ChunkStaging(16, 4, 99, torch.device("cpu"))
    seq = KVSequence(list(range(1, 11)))
    seq.block_table = [3]
    staging.fill(StepRow(seq, 0, 10), 16)
    staging.pad(16)
    t = staging.host.tolist()
    assert t[:16] == [0] * 16 and t[16:32] == [0] * 16 and t[32:48] == [99] * 16
    assert t[48:51] == [0, 0, 0] and t[51:67] == list(range(16))  # a bucket with every position's logits
