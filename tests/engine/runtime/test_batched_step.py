"""`Runner.step`: many sequences in one forward pass over the paged KV cache, against each sequence alone.

References are the transformers model (tiny random models, tests/support/tiny_models.py) and the engine's own
one-shot `predict_logits`; tolerance as in test_parity.py (fp32, 1e-4 relative to the logit scale). Block
accounting (prefix cache hits, snapshots, copy-on-write, freeing) is checked in whole blocks.
"""
from __future__ import annotations

import gc
import random

import pytest
import torch

from engine.model.batch import StepRow
from engine.errors import ContextLengthError
from engine.cache.block_manager import NoFreeBlocks
from engine.cache.kv_cache import kv_bytes_per_token
from tests.support.tiny_models import MOE_VARIANTS, assert_logits_close, hf_logits

BLOCK = 16  # the runner's default block size


@pytest.fixture(scope="module")
def tiny(tiny_zoo):
    """tiny(variant, blocks=None, prefix_caching=True) -> (a fresh runner, the HF reference model)."""
    from engine import load_runner

    def get(variant, blocks=None, prefix_caching=True):
        t = tiny_zoo.model(variant)
        memory = None
        if blocks is not None:
            probe = load_runner(str(t.safetensors_dir))
            memory = blocks * BLOCK * kv_bytes_per_token(probe.config, torch.float32)
        runner = load_runner(str(t.safetensors_dir), dtype=torch.float32, kv_cache_memory=memory,
                             prefix_caching=prefix_caching)
        assert runner.blocks.block_size == BLOCK
        if blocks is not None:
            assert runner.blocks.num_blocks == blocks
        return runner, t.hf_model

    return get


@pytest.fixture
def smollm_clean(smollm):
    """The session-wide SmolLM2 runner, without a session or cached prefixes before and after the test."""
    smollm.reset_session()
    smollm.blocks.reset_prefix_cache()
    yield smollm
    smollm.reset_session()
    smollm.blocks.reset_prefix_cache()


def rand_ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def expected_rows(rows: list[StepRow], full_logits: dict[int, torch.Tensor]) -> torch.Tensor:
    """What `step(rows)` returns, cut out of each sequence's full-sequence logits (keyed by id(seq))."""
    parts = []
    for row in rows:
        ref = full_logits[id(row.seq)]
        if row.logits == "all":
            parts.append(ref[row.start:row.end])
        elif row.logits == "last":
            parts.append(ref[row.end - 1:row.end])
    return torch.cat(parts)


def assert_pool_empty(runner) -> None:
    runner.reset_session()
    gc.collect()
    runner.new_sequence([1])  # any runner call that drains collected snapshots
    assert runner.blocks.num_used == 0, f"{runner.blocks.num_used} blocks still held"
    assert runner.blocks.num_free == runner.blocks.num_blocks


# ---------------------------------------------------------------------------------------------------
# many rows in one step


def _reference_for(request, tiny, which):
    """(runner, reference(ids) -> [len(ids), vocab] logits): HF for a tiny model, one-shot predict_logits for SmolLM2."""
    if which == "smollm":
        runner = request.getfixturevalue("smollm_clean")

        def ref(ids):
            out = runner.predict_logits(ids).clone()
            runner.reset_session()
            return out

        return runner, ref
    runner, model = tiny(which)
    return runner, lambda ids: hf_logits(model, ids)


@pytest.mark.parametrize("which", ["llama_tied", "qwen2", "qwen3", "gemma3", "smollm", *MOE_VARIANTS])
def test_mixed_prefill_and_decode_rows_match_each_sequence_alone(request, tiny, which):
    runner, reference = _reference_for(request, tiny, which)
    rng = random.Random(7)
    # name: (prompt length, total length); D is longer than gemma3's window (8) and crosses 3 blocks
    plan = {"A": (30, 40), "B": (12, 16), "C": (3, 10), "D": (45, 55), "E": (1, 7)}
    full = {k: rand_ids(total, i, runner.vocab_size) for i, (k, (_, total)) in enumerate(plan.items())}
    seqs = {k: runner.new_sequence(full[k][:p], use_prefix_cache=False) for k, (p, _) in plan.items()}
    ref = {id(seqs[k]): reference(full[k]) for k in plan}
    alone = {}
    if which != "smollm":  # there the reference is predict_logits already
        for k in plan:
            alone[id(seqs[k])] = runner.predict_logits(full[k]).clone()
        runner.reset_session()
    A, B, C, D, E = (seqs[k] for k in "ABCDE")

    def grow(seq, end):
        key = next(k for k, s in seqs.items() if s is seq)
        seq.tokens[len(seq.tokens):] = full[key][len(seq.tokens):end]

    def step(rows, what):
        for row in rows:
            grow(row.seq, row.end)
        out = runner.step(rows)
        assert_logits_close(out, expected_rows(rows, ref), what)
        if alone:
            assert_logits_close(out, expected_rows(rows, alone), what + " (vs predict_logits)")
        return out

    # 1: fresh prefills of 20 / 7 / 12 tokens, and one-token rows at position 0; "all", "none" and "last"
    out = step([StepRow(C, 0, 1), StepRow(A, 0, 20, "all"), StepRow(D, 0, 7, "none"), StepRow(B, 0, 12),
                StepRow(E, 0, 1)], "step 1")
    assert out.shape == (1 + 20 + 1 + 1, runner.vocab_size)
    # 2: prefill chunks continuing at positions > 0 (D: 38 tokens from 7, past the window), decode rows
    step([StepRow(D, 7, 45), StepRow(B, 12, 13), StepRow(A, 20, 30), StepRow(C, 1, 3, "all"), StepRow(E, 1, 2)],
         "step 2")
    assert [s.num_computed for s in (A, B, C, D, E)] == [30, 13, 3, 45, 2]
    # then batched decode, rows finishing at different times, in a shuffled order
    for i in range(12):
        live = [s for k, s in seqs.items() if s.num_computed < plan[k][1]]
        if not live:
            break
        rng.shuffle(live)
        step([StepRow(s, s.num_computed, s.num_computed + 1) for s in live], f"decode step {i} ({len(live)} rows)")
    assert all(s.num_computed == plan[k][1] for k, s in seqs.items())
    assert i == 10  # D and A need 10 decode steps, B 3, C 7, E 5
    for seq in seqs.values():
        runner.free_sequence(seq)
    assert_pool_empty(runner)


@pytest.mark.parametrize("which", ["qwen3", "gemma3", "smollm"])
def test_chunked_prefill_equals_one_shot_prefill(request, tiny, which):
    runner, reference = _reference_for(request, tiny, which)
    ids = rand_ids(37, 11, runner.vocab_size)
    expected = reference(ids)
    one_shot = runner.predict_logits(ids).clone()
    runner.reset_session()
    seq = runner.new_sequence(ids, use_prefix_cache=False)
    chunks = []
    for start in range(0, len(ids), 5):
        end = min(start + 5, len(ids))
        chunks.append(runner.step([StepRow(seq, start, end, "all")]))
        assert seq.num_computed == end
    chunked = torch.cat(chunks)
    assert_logits_close(chunked, one_shot, f"{which}: 5-token chunks vs one-shot prefill")
    assert_logits_close(chunked, expected, f"{which}: 5-token chunks vs reference")
    # the scheduler's way: middle chunks ask for no logits at all
    quiet = runner.new_sequence(ids, use_prefix_cache=False)
    for start in range(0, 35, 5):
        assert runner.step([StepRow(quiet, start, start + 5, "none")]).shape == (0, runner.vocab_size)
    last = runner.step([StepRow(quiet, 35, 37)])
    assert_logits_close(last[0], one_shot[-1], f"{which}: chunks without logits, then the last")
    runner.free_sequence(seq)
    runner.free_sequence(quiet)
    assert_pool_empty(runner)


# ---------------------------------------------------------------------------------------------------
# prefix cache


@pytest.mark.parametrize("variant", ["llama_tied", "qwen3", "gemma3"])
@pytest.mark.parametrize("shared, cached", [(40, 32), (48, 48), (15, 0)])
def test_prefix_cache_hit_computes_only_the_rest(tiny, variant, shared, cached):
    runner, model = tiny(variant)
    v = runner.vocab_size
    prefix = rand_ids(shared, 1, v)
    first_ids = prefix + rand_ids(10, 2, v)
    second_ids = prefix + rand_ids(9, 3, v)
    assert first_ids[shared] != second_ids[shared]

    first = runner.new_sequence(first_ids)
    assert first.num_cached == first.num_computed == 0
    runner.step([StepRow(first, 0, len(first_ids))])

    hits, used = runner.blocks.hits, runner.blocks.num_used
    second = runner.new_sequence(second_ids)
    assert second.num_cached == second.num_computed == cached
    assert runner.blocks.hits - hits == cached
    assert second.block_table == first.block_table[:cached // BLOCK]  # shared, not copied
    assert runner.blocks.num_used == used
    out = runner.step([StepRow(second, cached, len(second_ids), "all")])
    assert runner.blocks.num_used == used + -(-len(second_ids) // BLOCK) - cached // BLOCK  # only the rest is new
    expected = hf_logits(model, second_ids)
    assert_logits_close(out, expected[cached:], f"{variant}: after a {cached}-token cache hit")
    cold = runner.predict_logits(second_ids)[cached:].clone()
    assert_logits_close(out, cold, f"{variant}: cache hit vs cold computation")
    runner.reset_session()
    # and it decodes on correctly from there
    for token in rand_ids(3, 4, v):
        second.tokens.append(token)
        got = runner.step([StepRow(second, len(second.tokens) - 1, len(second.tokens))])
        assert_logits_close(got[0], hf_logits(model, second.tokens)[-1], f"{variant}: decode after cache hit")

    # released, the prefix stays cached (evictable) and is found again
    runner.free_sequence(first)
    runner.free_sequence(second)
    assert runner.blocks.num_used == 0
    third = runner.new_sequence(prefix + rand_ids(5, 5, v))
    assert third.num_cached == cached
    out = runner.step([StepRow(third, cached, len(third.tokens))])
    assert_logits_close(out[0], hf_logits(model, third.tokens)[-1], f"{variant}: hit on evictable blocks")
    runner.free_sequence(third)
    assert_pool_empty(runner)


def test_a_fully_cached_prompt_still_computes_its_last_token(tiny):
    runner, model = tiny("gemma3")
    ids = rand_ids(48, 6, runner.vocab_size)
    runner.prefill_logits(ids)
    runner.reset_session()
    seq = runner.new_sequence(ids)
    assert seq.num_cached == 32  # 3 blocks are cached, but the last token's logits must be computed
    out = runner.step([StepRow(seq, 32, 48)])
    assert_logits_close(out[0], hf_logits(model, ids)[-1], "gemma3: fully cached prompt")
    runner.free_sequence(seq)
    assert_pool_empty(runner)


def test_prefix_caching_off_never_hits(tiny):
    runner, model = tiny("qwen3", prefix_caching=False)
    ids = rand_ids(40, 7, runner.vocab_size)
    first = runner.new_sequence(ids)
    runner.step([StepRow(first, 0, 40)])
    second = runner.new_sequence(ids + [5])
    assert second.num_cached == second.num_computed == 0 and second.block_table == []
    assert runner.blocks.hits == 0
    out = runner.step([StepRow(second, 0, 41)])
    assert_logits_close(out[0], hf_logits(model, ids + [5])[-1], "qwen3 without prefix caching")
    runner.free_sequence(first)
    runner.free_sequence(second)
    assert not runner.blocks._evictable
    assert_pool_empty(runner)


def _greedy(runner, ids, n, use_prefix_cache):
    seq = runner.new_sequence(ids, use_prefix_cache)
    cached = seq.num_cached
    out = []
    logits = runner.step([StepRow(seq, seq.num_computed, len(seq.tokens))])[0]
    first = logits.clone()
    for _ in range(n):
        out.append(int(logits.argmax()))
        seq.tokens.append(out[-1])
        if len(out) < n:
            logits = runner.step([StepRow(seq, len(seq.tokens) - 1, len(seq.tokens))])[0]
    runner.free_sequence(seq)
    return out, cached, first


def test_smollm_greedy_with_a_cache_hit_equals_cold(smollm_clean):
    smollm = smollm_clean
    text = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
            "movable metal type, oil-based inks and a wooden screw press into a system that could produce books "
            "far faster than scribes. Within fifty years, presses had spread to more than two hundred cities")
    ids = smollm.tokenizer.encode(text)
    assert len(ids) > 3 * BLOCK
    hits = smollm.blocks.hits
    cold = smollm.generate(ids, 20)
    assert smollm.blocks.hits == hits  # nothing cached yet
    warm = smollm.generate(ids, 20)
    assert smollm.blocks.hits - hits == (len(ids) - 1) // BLOCK * BLOCK
    assert warm == cold, "greedy tokens with a prefix-cache hit differ from cold"

    # a different prompt sharing 3 blocks + a few tokens: hit vs cache disabled for this sequence
    other = ids[:3 * BLOCK + 5] + smollm.tokenizer.encode(" and in the next century the printing of newspapers")
    hit_tokens, cached, hit_first = _greedy(smollm, other, 20, use_prefix_cache=True)
    assert cached == 3 * BLOCK
    cold_tokens, cached, cold_first = _greedy(smollm, other, 20, use_prefix_cache=False)
    assert cached == 0
    assert_logits_close(hit_first, cold_first, "smollm: first logits with a cache hit vs cold")
    assert hit_tokens == cold_tokens
    assert_pool_empty(smollm)


# ---------------------------------------------------------------------------------------------------
# snapshots


@pytest.mark.parametrize("variant", ["llama_tied", "gemma3"])
def test_snapshot_shares_blocks_and_copies_one_partial_block_on_write(tiny, variant):
    runner, model = tiny(variant)
    bm = runner.blocks
    v = runner.vocab_size
    prompt = rand_ids(40, 8, v)           # 2 full blocks + 8 tokens
    ahead = rand_ids(10, 9, v)            # decoded after the export
    other = rand_ids(3, 10, v)            # decoded after restoring
    runner.prefill_logits(prompt)
    assert bm.num_used == 3
    snap = runner.export_session()
    assert len(snap) == 40 and snap.tokens == tuple(prompt)
    assert bm.num_used == 3, "a snapshot costs no block"

    expected = hf_logits(model, prompt + ahead)
    for i, token in enumerate(ahead):
        got = runner.decode_logits(token)
        assert_logits_close(got, expected[40 + i], f"{variant}: decode {i} after export")
        if i == 0:
            assert bm.num_used == 4, "the first write copies the shared partial block, and only it"
    assert bm.num_used == 5  # positions 48, 49 in a new block of the session's own

    # restore: the session decoded past the snapshot, which still holds the prompt's keys
    runner.restore_session(snap)
    assert runner.tokens == prompt
    assert bm.num_used == 3  # the session's own blocks went back (the full one stays cached)
    expected = hf_logits(model, prompt + other)
    for i, token in enumerate(other):
        assert_logits_close(runner.decode_logits(token), expected[40 + i], f"{variant}: decode {i} after restore")
    # a shorter restore, and a prompt reusing the snapshot
    runner.restore_session(snap, 35)
    assert_logits_close(runner.decode_logits(other[0]), hf_logits(model, prompt[:35] + other[:1])[-1],
                        f"{variant}: restore of 35 of 40 tokens")
    assert_logits_close(runner.prefill_logits_reusing(prompt + other, snap, 40), expected[-1],
                        f"{variant}: prefill reusing the snapshot")

    # dropping the snapshot gives its blocks back at the next runner call
    runner.reset_session()
    held = bm.num_used
    assert held == 3
    del snap
    gc.collect()
    assert bm.num_used == held  # collected, queued, not yet released
    seq = runner.new_sequence([1, 2, 3])
    assert bm.num_used == 0 and bm.num_free == bm.num_blocks
    runner.free_sequence(seq)


def test_snapshot_at_a_block_boundary_needs_no_copy(tiny):
    runner, model = tiny("qwen3")
    bm = runner.blocks
    prompt = rand_ids(32, 12, runner.vocab_size)
    runner.prefill_logits(prompt)
    snap = runner.export_session()
    assert bm.num_used == 2
    got = runner.decode_logits(7)
    assert bm.num_used == 3  # one new block, nothing copied
    assert_logits_close(got, hf_logits(model, prompt + [7])[-1], "qwen3: decode after an aligned export")
    runner.restore_session(snap)
    assert bm.num_used == 2
    del snap
    assert_pool_empty(runner)


# ---------------------------------------------------------------------------------------------------
# freeing and exhaustion


def test_pool_does_not_leak_over_many_cycles(tiny):
    runner, model = tiny("llama_tied", blocks=12)
    bm = runner.blocks
    v = runner.vocab_size
    rng = random.Random(3)
    stems = [rand_ids(rng.randint(10, 40), 100 + i, v) for i in range(3)]
    hits = 0
    for cycle in range(50):
        seqs = []
        for _ in range(rng.randint(1, 3)):
            ids = rng.choice(stems) + [rng.randrange(v) for _ in range(rng.randint(1, 20))]
            seqs.append(runner.new_sequence(ids))
            hits += seqs[-1].num_cached > 0
        runner.step([StepRow(s, s.num_computed, len(s.tokens)) for s in seqs])
        for _ in range(rng.randint(0, 3)):
            for s in seqs:
                s.tokens.append(rng.randrange(v))
            runner.step([StepRow(s, s.num_computed, len(s.tokens)) for s in seqs])
        if cycle % 5 == 0:  # a session with a snapshot, dropped without restoring
            runner.prefill_logits(rng.choice(stems) + [1, 2])
            snap = runner.export_session()
            runner.decode_logits(3)
            del snap
            gc.collect()
        for s in seqs:
            runner.free_sequence(s)
        runner.reset_session()
        runner.new_sequence([1])  # drains the collected snapshot
        assert bm.num_used == 0, f"cycle {cycle}: {bm.num_used} blocks leaked"
    assert hits > 10 and bm.num_free == bm.num_blocks
    # the whole pool can still be filled by one sequence (evicting every cached block), with correct logits
    ids = rand_ids(12 * BLOCK, 13, v)
    seq = runner.new_sequence(ids, use_prefix_cache=False)
    out = runner.step([StepRow(seq, 0, len(ids))])
    assert_logits_close(out[0], hf_logits(model, ids)[-1], "a sequence filling the whole pool")
    assert bm.num_used == bm.num_blocks
    runner.free_sequence(seq)


@pytest.mark.parametrize("variant", ["llama_tied", "gemma3"])
def test_no_free_blocks_leaves_the_runner_working(tiny, variant):
    runner, model = tiny(variant, blocks=4)  # 64 tokens
    bm = runner.blocks
    v = runner.vocab_size
    # a pool smaller than the model's context caps the context: one sequence can never outgrow the pool
    assert runner.context_size == 64
    with pytest.raises(ContextLengthError, match="70 tokens exceeds the context size of 64"):
        runner.new_sequence(rand_ids(70, 14, v))
    with pytest.raises(ContextLengthError):
        runner.prefill_logits(rand_ids(70, 14, v))
    assert bm.num_used == 0
    small = rand_ids(30, 15, v)
    assert_logits_close(runner.prefill_logits(small), hf_logits(model, small)[-1], f"{variant}: after NoFreeBlocks")
    runner.reset_session()

    # a batch whose second row does not fit: the first row's sequence is intact and continues correctly
    a_ids, b_ids = rand_ids(49, 16, v), rand_ids(30, 17, v)
    a = runner.new_sequence(a_ids[:48], use_prefix_cache=False)
    runner.step([StepRow(a, 0, 48)])       # 3 full blocks
    a.tokens.append(a_ids[48])
    b = runner.new_sequence(b_ids, use_prefix_cache=False)
    with pytest.raises(NoFreeBlocks):
        runner.step([StepRow(a, 48, 49), StepRow(b, 0, 30)])  # a takes the last block, b needs 2
    assert a.num_computed == 48 and b.num_computed == 0 and b.block_table == []
    out = runner.step([StepRow(a, 48, 49)])
    assert_logits_close(out[0], hf_logits(model, a_ids)[-1], f"{variant}: row retried after a failed batch")
    runner.free_sequence(a)
    out = runner.step([StepRow(b, 0, 30)])
    assert_logits_close(out[0], hf_logits(model, b_ids)[-1], f"{variant}: the row that did not fit, later")
    runner.free_sequence(b)

    # a session decoding into a full pool: the failed token is not kept, the session goes on after a free
    session = rand_ids(48, 18, v)
    runner.prefill_logits(session)                          # 3 full blocks
    other = runner.new_sequence(rand_ids(10, 19, v), use_prefix_cache=False)
    runner.step([StepRow(other, 0, 10)])                     # the 4th block
    assert bm.num_free == 0
    with pytest.raises(NoFreeBlocks):
        runner.decode_logits(5)
    assert runner.tokens == session
    runner.free_sequence(other)
    runner.restore_session(runner.export_session(), 40)  # drop the tail: 3 blocks
    assert_logits_close(runner.decode_logits(5), hf_logits(model, session[:40] + [5])[-1],
                        f"{variant}: session after NoFreeBlocks")
    assert_pool_empty(runner)
