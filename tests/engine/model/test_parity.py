"""The engine against transformers, on the random tiny models of tiny_models.py.

Every variant is loaded both from its safetensors directory and from its llama.cpp-layout F32 GGUF
(test_tiny_models.py proves that layout with transformers' own GGUF loader), and from GGUF copies
whose matrices are F16 / BF16 / Q8_0 / Q4_0 / Q4_1 / Q5_0 (the mixtures of experts: a few of these, their
3-D expert stacks in the type too, and gpt-oss's experts in MXFP4). Quantized copies are compared with the
HF model holding exactly the dequantized weights, so they are held to the same tolerance as F32.

Tolerance: |engine - HF| <= 1e-4 * max(1, max |HF logit|) (tiny_models.LOGIT_RTOL). The logits here
are a few units in size. Two correct fp32 implementations differ only by summation order: HF's own
eager and sdpa attention differ by 3e-6 to 9e-6 on these models, so the bound leaves ~50x headroom.
Real mistakes are far larger: a missing llama permutation, gemma's norm offset or the llama3 rope
scaling each move logits by more than 1e-2 (see the negative controls in test_tiny_models.py).
The greedy continuations used below have top-2 gaps above 2e-3 (checked there too), so greedy
tokens must match exactly.

Sequences are 24-token prompts plus 16 decoded tokens (or 36-token prefills): longer than gemma3's
sliding window of 8, and long enough for llama3's rope scaling to change the logits.
"""

import pytest
import torch

from tests.support.tiny_models import (
    GGUF_TYPES,
    MOE_GGUF_TYPES,
    MOE_VARIANTS,
    VARIANTS,
    assert_logits_close,
    hf_greedy,
    hf_logits,
    prompt_ids,
)

FORMATS = ["safetensors", "gguf"]
ALL_VARIANTS = VARIANTS + MOE_VARIANTS
# (variant, format) pairs: every family in both formats
CASES = [(v, f) for v in ALL_VARIANTS for f in FORMATS]
QUANTIZED = GGUF_TYPES[1:]
# (variant, GGUF type): every dense family in every quantized type; the mixtures of experts in the 8- and 4-bit
# block types (experts included), a few others, and experts as MXFP4 (gpt-oss's, and Qwen3-MoE's)
QUANTIZED_CASES = ([(v, t) for v in VARIANTS for t in QUANTIZED]
                   + [(v, t) for v in MOE_VARIANTS for t in ("Q8_0", "Q4_0")]
                   + [("qwen3_moe", "Q4_1"), ("qwen2_moe", "Q5_0"), ("mixtral", "BF16"), ("olmoe", "F16")]
                   + [(v, t) for v in ("gpt_oss", "qwen3_moe") for t in MOE_GGUF_TYPES])
PROMPT_LEN = 24
DECODE_STEPS = 16
LONG = 36


@pytest.fixture(scope="module")
def runner_for(tiny_zoo):
    """runner_for(variant, fmt, gguf_type) -> the engine's runner, loaded once per module."""
    cache = {}

    def get(variant, fmt="safetensors", gguf_type="F32"):
        key = (variant, fmt, gguf_type)
        if key not in cache:
            from engine import load_runner

            tiny = tiny_zoo.model(variant)
            path = tiny.safetensors_dir if fmt == "safetensors" else tiny_zoo.gguf(variant, gguf_type)
            cache[key] = load_runner(str(path), device="cpu", dtype=torch.float32)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def reference(tiny_zoo):
    """reference(variant, gguf_type) -> (prompt, greedy continuation, HF logits of prompt + continuation)."""
    cache = {}

    def get(variant, gguf_type="F32", steps=DECODE_STEPS):
        key = (variant, gguf_type, steps)
        if key not in cache:
            prompt = prompt_ids(tiny_zoo.model(variant), 0, PROMPT_LEN)
            cont, logits = hf_greedy(tiny_zoo.reference(variant, gguf_type), prompt, steps)
            cache[key] = prompt, cont, logits
        return cache[key]

    return get


@pytest.mark.parametrize("variant,fmt", CASES)
def test_loads_family_and_vocab(tiny_zoo, runner_for, variant, fmt):
    tiny = tiny_zoo.model(variant)
    runner = runner_for(variant, fmt)
    assert runner.family == tiny.family
    assert runner.vocab_size == tiny.config.vocab_size


@pytest.mark.parametrize("variant,fmt", CASES)
def test_prefill_logits_match_hf(tiny_zoo, runner_for, variant, fmt):
    tiny = tiny_zoo.model(variant)
    runner = runner_for(variant, fmt)
    ids = prompt_ids(tiny, 0, LONG)
    expected = hf_logits(tiny.hf_model, ids)
    assert_logits_close(runner.predict_logits(ids), expected, f"{variant}/{fmt} predict_logits (all positions)")
    assert_logits_close(runner.prefill_logits(ids), expected[-1], f"{variant}/{fmt} prefill_logits (last)")


@pytest.mark.parametrize("variant,fmt", CASES)
def test_cached_decode_matches_hf_full_sequence(runner_for, reference, variant, fmt):
    runner = runner_for(variant, fmt)
    prompt, cont, expected = reference(variant)
    n = len(prompt)
    assert_logits_close(runner.prefill_logits(prompt), expected[n - 1], f"{variant}/{fmt} prefill")
    for step, token in enumerate(cont):
        got = runner.decode_logits(token)
        assert_logits_close(got, expected[n + step], f"{variant}/{fmt} decode step {step} (position {n + step})")


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_safetensors_and_gguf_copies_give_the_same_logits(tiny_zoo, runner_for, variant):
    ids = prompt_ids(tiny_zoo.model(variant), 0, LONG)
    from_safetensors = runner_for(variant, "safetensors").predict_logits(ids).clone()
    from_gguf = runner_for(variant, "gguf").predict_logits(ids)
    assert_logits_close(from_gguf, from_safetensors, f"{variant}: GGUF vs safetensors")


@pytest.mark.parametrize("variant,gguf_type", QUANTIZED_CASES)
def test_quantized_gguf_matches_dequantized_reference(tiny_zoo, runner_for, reference, variant, gguf_type):
    tiny = tiny_zoo.model(variant)
    runner = runner_for(variant, "gguf", gguf_type)
    ref_model = tiny_zoo.reference(variant, gguf_type)
    ids = prompt_ids(tiny, 0, LONG)
    what = f"{variant}/{gguf_type}"
    assert_logits_close(runner.predict_logits(ids), hf_logits(ref_model, ids), f"{what} predict_logits")
    prompt, cont, expected = reference(variant, gguf_type, 4)
    assert_logits_close(runner.prefill_logits(prompt), expected[len(prompt) - 1], f"{what} prefill")
    for step, token in enumerate(cont):
        assert_logits_close(runner.decode_logits(token), expected[len(prompt) + step], f"{what} decode step {step}")


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_snapshot_restore_continues_like_the_original_session(tiny_zoo, runner_for, reference, variant):
    runner = runner_for(variant, "gguf")
    prompt, cont, expected = reference(variant)
    n = len(prompt)
    runner.prefill_logits(prompt)
    for token in cont[:4]:
        runner.decode_logits(token)
    snap = runner.export_session()
    assert len(snap) == n + 4
    first = runner.decode_logits(cont[4]).clone()
    assert_logits_close(first, expected[n + 4], f"{variant} decode before snapshot restore")

    # another session clobbers the cache, then the snapshot is restored twice
    runner.prefill_logits(prompt_ids(tiny_zoo.model(variant), 1, PROMPT_LEN))
    for attempt in range(2):
        runner.restore_session(snap)
        again = runner.decode_logits(cont[4])
        assert_logits_close(again, expected[n + 4], f"{variant} decode after restore #{attempt}")
        assert_logits_close(again, first, f"{variant} restored vs original session")
    # and the restored session keeps decoding correctly (greedy tokens included)
    for step in range(5, 10):
        assert int(again.argmax()) == cont[step], f"{variant}: greedy token {step} differs after restore"
        again = runner.decode_logits(cont[step])
        assert_logits_close(again, expected[n + step], f"{variant} decode step {step} after restore")


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_prefill_reusing_equals_cold_prefill(tiny_zoo, runner_for, reference, variant):
    tiny = tiny_zoo.model(variant)
    runner = runner_for(variant, "gguf")
    prompt, cont, expected = reference(variant)
    n = len(prompt)

    runner.prefill_logits(prompt)
    for token in cont[:4]:
        runner.decode_logits(token)
    snap = runner.export_session()  # prompt + cont[:4]

    # 1. the conversation grew: reuse all of the snapshot, compute 6 new tokens, then decode greedily
    ids = prompt + cont[:10]
    got = runner.prefill_logits_reusing(ids, snap, n + 4)
    assert_logits_close(got, expected[n + 9], f"{variant} reusing {n + 4} of {len(ids)}")
    reused_tokens = []
    for step in range(10, DECODE_STEPS):
        reused_tokens.append(int(got.argmax()))
        got = runner.decode_logits(reused_tokens[-1])
        assert_logits_close(got, expected[n + step], f"{variant} decode step {step} after reuse")
    cold = runner.prefill_logits(ids)
    assert_logits_close(cold, expected[n + 9], f"{variant} cold prefill")
    cold_tokens = []
    for _ in range(10, DECODE_STEPS):
        cold_tokens.append(int(cold.argmax()))
        cold = runner.decode_logits(cold_tokens[-1])
    assert reused_tokens == cold_tokens == cont[10:], f"{variant}: greedy tokens after reuse vs cold vs HF"

    # 2. a different prompt sharing only a prefix longer than gemma3's window: reuse 20, compute the rest
    other = prompt[:20] + prompt_ids(tiny, 1, PROMPT_LEN)[:12]
    want = hf_logits(tiny.hf_model, other)[-1]
    assert_logits_close(runner.prefill_logits_reusing(other, snap, 20), want, f"{variant} reusing a 20-token prefix")
    assert_logits_close(runner.prefill_logits(other), want, f"{variant} cold prefill of the other prompt")

    # 3. the very same tokens as the snapshot
    same = prompt + cont[:4]
    assert_logits_close(runner.prefill_logits_reusing(same, snap, len(same)), expected[n + 3], f"{variant} full reuse")


@pytest.mark.parametrize("variant,fmt", CASES)
def test_generate_equals_hf_greedy_generate(tiny_zoo, runner_for, reference, variant, fmt):
    tiny = tiny_zoo.model(variant)
    prompt, cont, _ = reference(variant)
    with torch.no_grad():
        out = tiny.hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=DECODE_STEPS,
            pad_token_id=tiny.config.pad_token_id if tiny.config.pad_token_id is not None else tiny.eos_token_id,
        )
    hf_tokens = out[0, len(prompt):].tolist()
    assert hf_tokens == cont, "reference check: HF generate (KV cache) vs HF full recomputation"

    seen = []
    got = runner_for(variant, fmt).generate(prompt, DECODE_STEPS, lambda token: seen.append(token) or True)
    assert got == hf_tokens, f"{variant}/{fmt}: engine generate vs HF greedy generate"
    assert seen == got, "on_token must see every generated token, in order"


def test_generate_stops_when_on_token_returns_false(runner_for, reference):
    prompt, cont, _ = reference("qwen3")
    calls = []

    def on_token(token):
        calls.append(token)
        return len(calls) < 3

    got = runner_for("qwen3", "safetensors").generate(prompt, DECODE_STEPS, on_token)
    assert calls == cont[:3], "on_token is called once per token, and not after it returned False"
    assert got == cont[:3], "the token for which on_token returned False is the last one returned"
