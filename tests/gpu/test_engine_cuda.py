"""The engine on a CUDA device (skipped without one; run on the GPU machine): every tiny family (the mixtures of experts
through the fused MoE kernel) against transformers,
decode steps replayed from CUDA graphs against the same steps run eagerly, and greedy decoding equal to
transformers' in float32."""
from __future__ import annotations

import pytest
import torch

from engine import load_runner
from engine.model.batch import StepRow, TokenFeed
from engine.cache.block_manager import PENDING_TOKEN
from engine.runtime.cuda_graphs import bucket_of
from tests.support.tiny_models import MOE_VARIANTS, VARIANTS, assert_logits_close, build_tiny_model, hf_greedy, hf_logits, \
    prompt_ids, reference_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def tinies(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("tiny-cuda")
    return {v: build_tiny_model(v, root / v) for v in VARIANTS + MOE_VARIANTS}


def _decode(runner, seqs, steps: int) -> list[torch.Tensor]:
    """Prefill `seqs`, then greedy decode steps of all of them together; the logits of each step on the host."""
    logits = runner.step([StepRow(s, s.num_computed, len(s.tokens)) for s in seqs])
    out = []
    for _ in range(steps):
        for seq, token in zip(seqs, logits.argmax(-1).tolist()):
            seq.tokens.append(token)
        logits = runner.step([StepRow(s, s.num_computed, len(s.tokens)) for s in seqs])
        out.append(logits.float().cpu())
    return out


@pytest.mark.parametrize("variant", VARIANTS + MOE_VARIANTS)
def test_float32_on_cuda_matches_transformers(tinies, variant) -> None:
    tiny = tinies[variant]
    model = reference_model(tiny, "F32")
    runner = load_runner(str(tiny.safetensors_dir), device="cuda", dtype="float32")
    ids = prompt_ids(tiny, 0, 36)  # past gemma3's window of 8
    assert_logits_close(runner.predict_logits(ids).cpu(), hf_logits(model, ids), f"{variant} prefill on cuda")
    runner.capture_cuda_graphs(8)
    expected, _ = hf_greedy(model, ids[:12], 20)
    assert runner.generate(ids[:12], 20) == expected  # prefill eager, decode from the graphs


@pytest.mark.parametrize("variant", VARIANTS + MOE_VARIANTS)
def test_bfloat16_on_cuda_is_close_to_transformers(tinies, variant) -> None:
    tiny = tinies[variant]
    model = reference_model(tiny, "F32")
    runner = load_runner(str(tiny.safetensors_dir), device="cuda")
    assert runner.dtype == torch.bfloat16
    ids = prompt_ids(tiny, 1, 30)
    got, want = runner.predict_logits(ids).cpu(), hf_logits(model, ids)
    if variant in MOE_VARIANTS:
        # In bfloat16 a token whose router scores nearly tie can pick another expert than in float32 (the CPU engine
        # in bfloat16 shows the same jumps at the same positions): the reference is the CPU engine in bfloat16,
        # and float32 on CUDA matches transformers to 1e-4 (test_float32_on_cuda_matches_transformers).
        want = load_runner(str(tiny.safetensors_dir), device="cpu", dtype="bfloat16", quant="none").predict_logits(ids)
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) < 0.05 * scale, (variant, float((got - want).abs().max()), scale)


@pytest.mark.parametrize("variant", ["llama_tied", "qwen3", "gemma3", *MOE_VARIANTS])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_equals_eager_steps(tinies, variant, dtype) -> None:
    """Five sequences of different lengths (one past gemma3's window), 12 decode steps: from the graph of bucket 8
    (three padding rows) and eagerly through the same paged kernels."""
    tiny = tinies[variant]
    results = []
    for graphs in (False, True):
        runner = load_runner(str(tiny.safetensors_dir), device="cuda", dtype=dtype)
        if graphs:
            runner.capture_cuda_graphs(8)
            assert bucket_of(5, runner.graphs.buckets) == 8
        seqs = [runner.new_sequence(prompt_ids(tiny, i % 2, n), use_prefix_cache=False) for i, n in
                enumerate([3, 17, 9, 30, 12])]
        results.append(_decode(runner, seqs, 12))  # the prefill is eager either way
        for s in seqs:
            runner.free_sequence(s)
        assert runner.blocks.num_used == 0
    tol = 1e-4 if dtype == "float32" else 3e-2
    for step, (eager, replayed) in enumerate(zip(*results)):
        scale = max(1.0, float(eager.abs().max()))
        assert float((eager - replayed).abs().max()) <= tol * scale, (variant, dtype, step)


@pytest.mark.parametrize("variant", ["llama_tied", "qwen3", "gemma3", "qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunk_graphs_equal_eager_steps(tinies, variant, dtype) -> None:
    """Prompt chunks replayed from their buckets' graphs (engine/runtime/chunk_graphs.py) against the same steps run
    eagerly: two fresh prompts in one step (buckets 32 and 16), then decode steps of both with a third prompt
    joining, a fourth whose first block comes from the prefix cache (a chunk over cached blocks), past gemma3's
    window, and a speculative verification row (four drafts and the last token, every position's logits)."""
    tiny = tinies[variant]
    results = []
    for graphs in (False, True):
        runner = load_runner(str(tiny.safetensors_dir), device="cuda", dtype=dtype)
        if graphs:
            runner.capture_cuda_graphs(8, chunk_tokens=64)
            assert runner.chunk_graphs.buckets == [16, 32, 64]
        a, b = (runner.new_sequence(prompt_ids(tiny, i, n)) for i, n in ((0, 30), (1, 12)))
        rows = [StepRow(a, 0, 30), StepRow(b, 0, 12)]
        steps = [runner.step(rows).float().cpu()]
        seqs = [a, b]
        for i in range(6):
            at = 0
            for row in rows:  # each row's next token, from its last logits
                at += row.end - row.start if row.logits == "all" else 1
                row.seq.tokens.append(int(steps[-1][at - 1].argmax()))
            if i == 4:
                a.tokens.extend(prompt_ids(tiny, 1, 4))  # drafts, verified in one row
            rows = [StepRow(s, s.num_computed, len(s.tokens), "all" if s is a and i == 4 else "last")
                    for s in seqs]
            if i in (1, 3):
                # a fresh prompt, then one sharing the first prompt's first block (computed from the cache on)
                new = runner.new_sequence(prompt_ids(tiny, 1, 20) if i == 1 else prompt_ids(tiny, 0, 40))
                assert new.num_computed == (0 if i == 1 else runner.blocks.block_size)
                rows.append(StepRow(new, new.num_computed, len(new.tokens)))
                seqs.append(new)
            steps.append(runner.step(rows).float().cpu())
        results.append(steps)
        for s in seqs:
            runner.free_sequence(s)
        assert runner.blocks.num_used == 0
    tol = 1e-4 if dtype == "float32" else 3e-2
    for step, (eager, replayed) in enumerate(zip(*results)):
        assert eager.shape == replayed.shape
        scale = max(1.0, float(eager.abs().max()))
        assert float((eager - replayed).abs().max()) <= tol * scale, (variant, dtype, step)


@pytest.mark.parametrize("variant", ["llama_tied", "gemma3"])
def test_prompts_of_one_eager_step_equal_each_alone(tinies, variant) -> None:
    """Three fresh prompts in one eager step go through one paged prefill call; each alone through fused
    attention (SDPA): the same next-token logits (float32), gemma3's longest prompt past its window."""
    tiny = tinies[variant]
    runner = load_runner(str(tiny.safetensors_dir), device="cuda", dtype="float32", prefix_caching=False)
    prompts = [prompt_ids(tiny, i % 2, n) for i, n in enumerate((30, 12, 21))]
    alone = []
    for ids in prompts:
        seq = runner.new_sequence(ids)
        alone.append(runner.step([StepRow(seq, 0, len(ids))])[0].cpu())
        runner.free_sequence(seq)
    seqs = [runner.new_sequence(ids) for ids in prompts]
    together = runner.step([StepRow(s, 0, len(s.tokens)) for s in seqs]).cpu()
    for i, want in enumerate(alone):
        assert_logits_close(together[i], want, f"{variant} prompt {i} of a batched eager step")


def test_graphs_serve_only_pure_decode_steps(tinies) -> None:
    tiny = tinies["llama_tied"]
    runner = load_runner(str(tiny.safetensors_dir), device="cuda", dtype="float32")
    runner.capture_cuda_graphs(4)
    a, b = (runner.new_sequence(prompt_ids(tiny, i, 10), use_prefix_cache=False) for i in (0, 1))
    rows = [StepRow(a, 0, 10), StepRow(b, 0, 10)]
    assert not runner.graphs.serves(rows)
    runner.step(rows)
    a.tokens.append(5)
    b.tokens.append(6)
    assert runner.graphs.serves([StepRow(a, 10, 11), StepRow(b, 10, 11)])
    assert not runner.graphs.serves([StepRow(a, 10, 11, logits="all")])
    many = [StepRow(a, 10, 11)] * 5
    assert not runner.graphs.serves(many)  # past the largest bucket (4)


@pytest.mark.parametrize("graphs", [False, True])
def test_fed_tokens_equal_host_tokens(tinies, graphs) -> None:
    """Decode steps that read each row's token on the device (TokenFeed, async scheduling) compute what the same
    steps compute with the tokens from the host: fed in the order they were sampled, in another order, with a row
    not fed, and beside a prompt chunk (graph steps: the decode bucket's input fix-up and GraphStep's split);
    through the graphs and eagerly."""
    tiny = tinies["qwen3"]
    results = []
    for fed in (False, True):
        runner = load_runner(str(tiny.safetensors_dir), device="cuda", dtype="float32")
        if graphs:
            runner.capture_cuda_graphs(8, chunk_tokens=64)
        seqs = [runner.new_sequence(prompt_ids(tiny, i % 2, n), use_prefix_cache=False)
                for i, n in enumerate([3, 17, 9, 30, 12])]
        chunk = runner.new_sequence(prompt_ids(tiny, 1, 20), use_prefix_cache=False)
        logits = runner.step([StepRow(s, 0, len(s.tokens)) for s in seqs])
        order, out = list(range(5)), []
        for step in range(8):
            tokens = logits.argmax(-1)  # row i: seqs[order[i]]
            host = tokens.tolist()
            for i, j in enumerate(order):
                seqs[j].tokens.append(PENDING_TOKEN if fed else host[i])
            new_order = order if step % 3 == 0 else order[::-1]
            sources = [order.index(j) for j in new_order]
            if step == 6:  # a row whose token the host has
                seqs[new_order[2]].tokens[-1] = host[sources[2]]
                sources[2] = -1
            rows = [StepRow(seqs[j], seqs[j].num_computed, len(seqs[j].tokens)) for j in new_order]
            if step == 4:
                rows.insert(1, StepRow(chunk, 0, 16, "none"))
                sources.insert(1, -1)
            logits = runner.step(rows, TokenFeed(tokens, sources)) if fed else runner.step(rows)
            for i, j in enumerate(order):
                seqs[j].tokens[-1] = host[i]  # the host has the tokens now
            out.append(logits.float().cpu())
            order = new_order
        results.append(out)
        assert all(PENDING_TOKEN not in s.tokens for s in seqs)
        for s in seqs + [chunk]:
            runner.free_sequence(s)
    for step, (host_fed, device_fed) in enumerate(zip(*results)):
        assert torch.equal(host_fed, device_fed), (graphs, step)


def _compiled_kernels() -> int:
    """How many specializations of the engine's Triton kernels this process has compiled."""
    import triton

    from engine.kernels import fused_triton as fused_kernels_triton, paged_attention_triton
    kernels = [k for m in (fused_kernels_triton, paged_attention_triton) for k in vars(m).values()
               if isinstance(k, triton.runtime.jit.JITFunction)]
    if not kernels or not all(hasattr(k, "device_caches") for k in kernels):
        pytest.skip("this Triton keeps its compiled kernels elsewhere")
    return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())


@pytest.mark.parametrize("variant", ["llama_tied", "gemma3"])
def test_serving_after_capture_compiles_no_kernel(tinies, variant) -> None:
    """Start-up warms every kind of eager step: afterwards steps of 1-8 prompt rows (fresh, then chunks over their
    cached blocks; more tokens than the chunk graphs take) and decode steps compile nothing new while serving."""
    tiny = tinies[variant]
    runner = load_runner(str(tiny.safetensors_dir), device="cuda")
    runner.capture_cuda_graphs(8, chunk_tokens=256)
    before = _compiled_kernels()
    ids = torch.Generator().manual_seed(0)
    for rows in (1, 2, 3, 4, 5, 8):
        length = min(200, 280 // rows + 1)
        seqs = [runner.new_sequence(torch.randint(3, runner.vocab_size, (length,), generator=ids).tolist(),
                                    use_prefix_cache=False) for _ in range(rows)]
        runner.step([StepRow(s, 0, length) for s in seqs])
        for seq in seqs:
            seq.tokens += torch.randint(3, runner.vocab_size, (length,), generator=ids).tolist()
        _decode(runner, seqs, 2)
        for seq in seqs:
            runner.free_sequence(seq)
    assert _compiled_kernels() == before
