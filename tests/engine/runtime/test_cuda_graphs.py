"""What CUDA-graph decode steps (engine/runtime/cuda_graphs.py) are made of, checked on CPU: the bucket choice, and the
static inputs a bucket is filled with, which must give a step's rows the logits the ordinary step gives them (the
padding rows writing only the spare slot). The capture and replay themselves run in tests/gpu/test_engine_cuda.py."""
from __future__ import annotations

import pytest
import torch

from engine import load_runner
from engine.model.batch import StepRow
from engine.runtime.cuda_graphs import BUCKETS, StepStaging, bucket_of, buckets_for, table_width
from engine.cache.kv_cache import PagedKVCache
from tests.support.tiny_models import prompt_ids


def test_buckets_double_up_to_the_largest_batch() -> None:
    assert buckets_for(1) == [1]
    assert buckets_for(32) == [1, 2, 4, 8, 16, 32]
    assert buckets_for(33) == [1, 2, 4, 8, 16, 32, 64]
    assert buckets_for(256)[-1] == 256 and len(buckets_for(256)) == 9
    for max_batch in range(1, 300):
        buckets = buckets_for(max_batch)
        for rows in range(1, max_batch + 1):
            bucket = bucket_of(rows, buckets)
            assert rows <= bucket < 2 * rows  # padding at most doubles a step
        assert bucket_of(buckets[-1] + 1, buckets) is None
    assert buckets_for(2000)[-1] == 2000 and BUCKETS[-1] < 2000
    with pytest.raises(ValueError):
        buckets_for(0)


@pytest.mark.parametrize("variant", ["llama_tied", "gemma3"])
def test_a_filled_bucket_gives_each_row_its_logits(tiny_zoo, variant) -> None:
    """Five decode rows in a bucket of 8 through the paged-attention path (its torch fallback here), against the
    ordinary CPU step; the three padding rows write their keys to the spare slot and nowhere else."""
    tiny = tiny_zoo.model(variant)
    runner = load_runner(str(tiny.safetensors_dir), dtype="float32")
    bs = runner.blocks.block_size
    # a pool with one spare block past the manager's, as on a GPU
    spare_cache = PagedKVCache(runner.config, runner.blocks.num_blocks + 1, bs, runner.dtype, runner.device)
    seqs = [runner.new_sequence(prompt_ids(tiny, i % 2, n), use_prefix_cache=False) for i, n in
            enumerate([3, 17, 9, 30, 12])]
    runner.step([StepRow(s, 0, len(s.tokens)) for s in seqs])
    for s in seqs:
        s.tokens.append(7)
    rows = [StepRow(s, s.num_computed, len(s.tokens)) for s in seqs]
    for i in range(runner.config.num_layers):  # the same cache contents in the pool with the spare block
        spare_cache.keys[i][:, :runner.cache.keys[i].shape[1]] = runner.cache.keys[i]
        spare_cache.values[i][:, :runner.cache.values[i].shape[1]] = runner.cache.values[i]
    for row in rows:
        runner.blocks.allocate(row.seq, row.end)
    staging = StepStaging(8, table_width(runner.context_size, bs), runner.blocks.num_blocks * bs, runner.device)
    staging.fill(rows, bs)
    staging.upload()
    with torch.inference_mode():
        graphed = runner.model(staging.batch(bs), spare_cache)[:5]
    expected = runner.step(rows)
    assert torch.allclose(graphed, expected, atol=1e-4, rtol=1e-4), float((graphed - expected).abs().max())
    used = runner.blocks.num_blocks * bs
    for i in range(runner.config.num_layers):
        # the rows' keys where they belong (padding wrote nothing there), the spare block taking the padding's
        assert torch.allclose(spare_cache.keys[i][:, :used], runner.cache.keys[i], atol=1e-5)
        assert spare_cache.keys[i][:, used:].abs().sum() > 0  # ... but into the spare block
