"""The shipped models through the public Runner API: known answers, KV-cached decode, sessions, context cap."""
from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

from engine import ContextLengthError, KNOWN_MODELS, Runner, load_runner
from engine.weights.gguf_format import GGUFCursor

FRANCE = "The capital of France is"


def test_smollm_capital_of_france(smollm: Runner) -> None:
    ids = smollm.tokenizer.encode(FRANCE)
    assert ids == [504, 3575, 282, 4649, 314]
    logits = smollm.prefill_logits(ids)
    assert logits.shape == (49152,) and logits.dtype == torch.float32
    assert int(logits.argmax()) == 7042 and smollm.tokenizer.decode([7042]) == " Paris"
    assert float(logits[7042]) == pytest.approx(17.37, abs=0.05)  # reference: fp32 from dequantized weights


def test_smollm_chat_answers_two_plus_two(smollm: Runner) -> None:
    ids = smollm.tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                               add_generation_prompt=True)
    end = smollm.tokenizer.end_token_ids
    out = smollm.generate(ids, 40, lambda t: t not in end)
    text = smollm.tokenizer.decode(out, skip_special_tokens=True)
    assert out[-1] in end, f"no end of turn within 40 tokens: {text!r}"
    assert "4" in text, text


def test_decode_uses_cache_and_matches_full_forward(smollm: Runner) -> None:
    ids = smollm.tokenizer.encode("def fibonacci(n):")
    assert ids == [1604, 3987, 46477, 24, 94, 727]
    seen_lengths: list[int] = []
    hook = smollm.model.register_forward_pre_hook(lambda _m, args: seen_lengths.append(args[0].ids.shape[0]))
    try:
        tokens = smollm.generate(ids, 12)
    finally:
        hook.remove()
    assert seen_lengths == [len(ids)] + [1] * 11  # one prefill, then one new token per step (O(L) decode)
    full = smollm.predict_logits(ids + tokens)
    # greedy tokens from cached decode are the argmax of the full forward at every step
    assert full[len(ids) - 1:-1].argmax(-1).tolist() == tokens


def test_reuse_and_restore_equal_cold_prefill(smollm: Runner) -> None:
    prefix = smollm.tokenizer.encode("Once upon a time, in a land far away, there lived")
    prompt = prefix + smollm.tokenizer.encode(" a dragon who loved to")
    cold = smollm.prefill_logits(prompt)
    cold_tokens = smollm.generate(prompt, 8)

    smollm.prefill_logits(prefix + smollm.tokenizer.encode(" a cat"))
    snapshot = smollm.export_session()
    reuse = smollm.common_prefix_len(prompt, snapshot)
    assert reuse >= len(prefix)
    warm = smollm.prefill_logits_reusing(prompt, snapshot, reuse)
    torch.testing.assert_close(warm, cold, atol=1e-4, rtol=1e-4)
    assert int(warm.argmax()) == int(cold.argmax())

    smollm.prefill_logits(prompt)
    full_snapshot = smollm.export_session()
    smollm.prefill_logits(smollm.tokenizer.encode("something else entirely"))
    smollm.restore_session(full_snapshot)
    assert int(smollm.decode_logits(cold_tokens[0]).argmax()) == cold_tokens[1]
    assert len(full_snapshot) == len(prompt)  # later decoding did not change the snapshot


def test_reuse_rejects_mismatched_prefix(smollm: Runner) -> None:
    smollm.prefill_logits(smollm.tokenizer.encode("Hello there"))
    snap = smollm.export_session()
    with pytest.raises(ValueError, match="differs"):
        smollm.prefill_logits_reusing(smollm.tokenizer.encode("Goodbye there"), snap, 2)


def test_context_cap() -> None:
    runner = load_runner("smollm2-135m", max_context=16)
    assert runner.context_size == 16
    with pytest.raises(ContextLengthError, match="17 tokens exceeds the context size of 16"):
        runner.prefill_logits(list(range(100, 117)))
    runner.prefill_logits(list(range(100, 116)))
    with pytest.raises(ContextLengthError):
        runner.decode_logits(5)
    # 10 prompt tokens + 6 decoded fill the 16 positions; the 7th token is predicted from the full context
    assert len(runner.generate(list(range(100, 110)), 50)) == 7
    with pytest.raises(ValueError, match="trained context"):
        load_runner("smollm2-135m", max_context=10**6)


def test_bfloat16_runs_close_to_fp32(smollm: Runner) -> None:
    bf16 = load_runner("smollm2-135m", dtype="bfloat16")
    ids = smollm.tokenizer.encode(FRANCE)
    logits = bf16.prefill_logits(ids)
    assert bf16.dtype == torch.bfloat16 and logits.dtype == torch.float32
    assert int(logits.argmax()) == 7042
    # int4 weights, and activations rounded to int8 per block of 32 where engine/model/quant/dot.py serves (the quality
    # guard in test_quantized bounds what that costs over whole texts): within two logits of float32's
    assert (logits - smollm.prefill_logits(ids)).abs().max() < 2.0


def without_vocabulary(path: Path, dest: Path) -> Path:
    """A copy of the GGUF file at `path` without its tokenizer's token, score and type arrays, and with the
    vocabulary size they implied as `<arch>.vocab_size`: the metadata entries, tensor directory and tensor bytes
    otherwise copied byte for byte. transformers parses 262,144-entry arrays field by field, twice per load (most of
    this test's time before; bench/RESULTS.md#issue-13-suite-time), and the model needs none of them."""
    data = path.read_bytes()
    cur = GGUFCursor(memoryview(data), path)
    cur.pos = 4
    version, n_tensors, n_kv = cur.scalar("<I"), cur.scalar("<Q"), cur.scalar("<Q")
    kept, arch, alignment = [], "", 32
    for _ in range(n_kv):
        start = cur.pos
        key = cur.string()
        value = cur.value(cur.scalar("<I"))
        arch = value if key == "general.architecture" else arch
        alignment = value if key == "general.alignment" else alignment
        if key not in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
            kept.append(data[start:cur.pos])
        elif key == "tokenizer.ggml.tokens":
            vocab = len(value)
    name = f"{arch}.vocab_size".encode()
    kept.append(struct.pack("<Q", len(name)) + name + struct.pack("<II", 4, vocab))  # 4: uint32
    directory = cur.pos
    for _ in range(n_tensors):
        cur.string()
        dims = cur.scalar("<I")
        cur.pos += 8 * dims + 4 + 8  # the dimensions, the type, the offset
    tensors_at = (cur.pos + alignment - 1) // alignment * alignment
    head = data[:4] + struct.pack("<IQQ", version, n_tensors, len(kept)) + b"".join(kept) + data[directory:cur.pos]
    dest.write_bytes(head + bytes(-len(head) % alignment) + data[tensors_at:])
    return dest


@pytest.mark.slow
def test_gemma_top5_matches_transformers(gemma: Runner, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    ids = gemma.tokenizer.encode(FRANCE)
    assert ids == [2, 818, 5279, 529, 7001, 563]
    ours = gemma.prefill_logits(ids)
    assert torch.topk(ours, 3).indices.tolist() == [506, 496, 9079]
    path = without_vocabulary(KNOWN_MODELS["gemma3-270m"].path(), tmp_path / "gemma3-270m.gguf")
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    assert hf.config.vocab_size == 262_144 and hf.config.sliding_window == 512
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    top = torch.topk(ref, 5).indices
    assert torch.topk(ours, 5).indices.tolist() == top.tolist()
    assert (ours[top] - ref[top]).abs().max() < 0.05
