"""Runner.embed: all-MiniLM-L6-v2 against sentence-transformers' own output on 50 varied sentences, and decoder
embeddings (llama-server's last-token and mean pooling of the final norm's output) against transformers' hidden
states on the random tiny decoders."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import load_runner
from engine.cache.block_manager import NoFreeBlocks
from engine.cache.kv_cache import kv_bytes_per_token
from engine.registry import KNOWN_MODELS

SENTENCES = json.loads((Path(__file__).parents[2] / "data" / "embedding_sentences.json").read_text())
MIN_COSINE = 0.9999


@pytest.fixture(scope="module")
def sentence_transformer():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(KNOWN_MODELS["all-minilm-l6-v2"].path()), device="cpu")


@pytest.fixture(scope="module")
def reference(sentence_transformer) -> torch.Tensor:
    """sentence-transformers' embeddings of SENTENCES (its Transformer, mean Pooling and Normalize modules)."""
    return sentence_transformer.encode(SENTENCES, batch_size=64, convert_to_tensor=True).float()


def test_minilm_tokenizes_as_sentence_transformers(sentence_transformer) -> None:
    runner = load_runner("all-minilm-l6-v2")
    assert len(SENTENCES) == 50
    for text in SENTENCES:
        assert runner.tokenizer.encode(text) == sentence_transformer.tokenizer(text)["input_ids"], text


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_minilm_matches_sentence_transformers(reference: torch.Tensor, dtype: str) -> None:
    runner = load_runner("all-minilm-l6-v2", dtype=dtype)
    assert runner.is_encoder and runner.pooling == "mean" and runner.context_size == 512
    ids = [runner.tokenizer.encode(text) for text in SENTENCES]
    together = runner.embed(ids)
    assert together.shape == (50, 384) and together.dtype == torch.float32
    cosine = F.cosine_similarity(together, reference)
    assert cosine.min() >= MIN_COSINE, f"{dtype}: sentence {int(cosine.argmin())} at cosine {cosine.min():.6f}"
    if dtype == "float32":  # the batch changes nothing but the summation order
        alone = torch.cat([runner.embed([x]) for x in ids[:8]])
        torch.testing.assert_close(alone, together[:8], rtol=0, atol=1e-6)


@pytest.mark.parametrize("variant", ["llama_tied", "gemma3"])
def test_decoder_embeddings_pool_the_final_norm_output(tiny_zoo, variant: str) -> None:
    """Sequences of 1 to 30 tokens in one pass (gemma3's sliding window is 8), last and mean pooling."""
    tiny = tiny_zoo.model(variant)
    runner = load_runner(tiny.safetensors_dir, dtype="float32")
    assert not runner.is_encoder and runner.pooling == "last"
    gen = torch.Generator().manual_seed(3)
    inputs = [torch.randint(5, runner.vocab_size, (n,), generator=gen).tolist() for n in (1, 30, 9, 17, 2)]
    with torch.no_grad():
        states = [tiny.hf_model.model(input_ids=torch.tensor([ids])).last_hidden_state[0] for ids in inputs]
    for mode, pick in (("last", lambda s: s[-1]), ("mean", lambda s: s.mean(0))):
        expected = F.normalize(torch.stack([pick(s) for s in states]), dim=1)
        torch.testing.assert_close(runner.embed(inputs, mode), expected, rtol=0, atol=2e-5, msg=mode)
    assert runner.blocks.num_used == 0  # the pass's KV blocks are given back


def test_decoder_embeddings_need_room_in_the_kv_pool(tiny_zoo) -> None:
    tiny = tiny_zoo.model("llama_tied")
    per_token = kv_bytes_per_token(load_runner(tiny.safetensors_dir, dtype="float32").config, torch.float32)
    runner = load_runner(tiny.safetensors_dir, dtype="float32", kv_cache_memory=per_token * 64)  # 4 blocks
    assert runner.embedding_fits([16, 16, 30]) and not runner.embedding_fits([16, 16, 17, 1])
    with pytest.raises(NoFreeBlocks):
        runner.embed([[5] * 16, [6] * 16, [7] * 17, [8]])
    assert runner.blocks.num_used == 0
    assert runner.embed([[5] * 16, [6] * 48]).shape == (2, runner.embedding_size)
