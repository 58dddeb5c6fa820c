"""The BERT encoder (engine/model/bert.py) against transformers' BertModel on random tiny checkpoints: the last
hidden states of sentences of different lengths batched together (padding masked), and their pooled embeddings.

Tolerance: 1e-5 of the states' size. Two fp32 implementations differ by summation order only (~1e-6 here); a
mistake (a missing mask, a wrong norm position, tanh GELU for erf, positions off by one) moves
them by 100x that or more, as the negative controls below show.
"""
from __future__ import annotations

import string
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from engine import load_runner
from engine.model.bert import pack_sentences

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
SENTENCES = ["hello world", "a", "the quick brown fox jumps over the lazy dog", "zebra crossing", "b c d e f"]


def _write_tokenizer(out: Path) -> None:
    """A WordPiece tokenizer.json laid out as BERT's (and, like sentence-transformers' files, padding and
    truncating to fixed lengths, which the engine must switch off)."""
    letters = list(string.ascii_lowercase)
    vocab = {t: i for i, t in enumerate([*SPECIAL, *letters, *(f"##{c}" for c in letters)])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(SPECIAL)
    tok.enable_truncation(8)
    tok.enable_padding(length=16)
    tok.save(str(out / "tokenizer.json"))


def _tiny_bert(out: Path, head: str = "none", hidden_act: str = "gelu", seed: int = 0):
    """A random BertModel (or BertForMaskedLM: a `bert.` prefix and a head to skip) saved as safetensors."""
    from transformers import BertConfig, BertForMaskedLM, BertModel

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=48, max_position_embeddings=40, hidden_act=hidden_act,
                        initializer_range=0.3, layer_norm_eps=1e-12)
    model = (BertForMaskedLM if head == "mlm" else BertModel)(config).eval()
    for module in model.modules():  # LayerNorms away from the identity, so that misplacing one shows
        if isinstance(module, torch.nn.LayerNorm):
            torch.nn.init.normal_(module.weight, 1.0, 0.3)
            torch.nn.init.normal_(module.bias, 0.0, 0.3)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    _write_tokenizer(out)
    bert = model.bert if head == "mlm" else model
    bert.set_attn_implementation("eager")
    return bert


def _hf_hidden(bert, inputs: list[list[int]]) -> list[torch.Tensor]:
    longest = max(map(len, inputs))
    ids = torch.tensor([x + [0] * (longest - len(x)) for x in inputs])
    mask = torch.tensor([[1] * len(x) + [0] * (longest - len(x)) for x in inputs])
    with torch.no_grad():
        states = bert(input_ids=ids, attention_mask=mask).last_hidden_state
    return [states[i, :len(x)] for i, x in enumerate(inputs)]


def _close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5) -> bool:
    return bool((actual - expected).abs().max() <= rtol * max(1.0, expected.abs().max().item()))


@pytest.mark.parametrize("head, act", [("none", "gelu"), ("mlm", "gelu"), ("none", "gelu_new")])
def test_hidden_states_and_embeddings_match_transformers(tmp_path: Path, head: str, act: str) -> None:
    bert = _tiny_bert(tmp_path, head, act)
    runner = load_runner(tmp_path, dtype="float32")
    assert runner.is_encoder and runner.pooling == "mean" and runner.embedding_size == 32
    inputs = [runner.tokenizer.encode(s) for s in SENTENCES]
    assert [len(x) for x in inputs] == [12, 3, 37, 15, 7]  # neither padded nor cut by the file's settings
    expected = _hf_hidden(bert, inputs)
    with torch.inference_mode():
        got = runner.model(pack_sentences(inputs, runner.device))
    for i, states in enumerate(torch.split(got, [len(x) for x in inputs])):
        assert _close(states, expected[i]), f"sentence {i}"
    for mode in ("mean", "cls", "last"):
        pick = {"mean": lambda s: s.mean(0), "cls": lambda s: s[0], "last": lambda s: s[-1]}[mode]
        reference = torch.nn.functional.normalize(torch.stack([pick(s) for s in expected]), dim=1)
        assert _close(runner.embed(inputs, mode), reference), mode
    # one sentence alone (no padding at all) gives what it gives in the batch
    assert _close(runner.embed(inputs[2:3]), runner.embed(inputs)[2:3])


def test_negative_controls_show_the_tolerance_catches_mistakes(tmp_path: Path) -> None:
    bert = _tiny_bert(tmp_path)
    runner = load_runner(tmp_path, dtype="float32")
    inputs = [runner.tokenizer.encode(s) for s in SENTENCES]
    expected = torch.cat(_hf_hidden(bert, inputs))
    batch = pack_sentences(inputs, runner.device)
    with torch.inference_mode():
        unmasked = runner.model(batch._replace(key_mask=None))  # attends to padding keys
        shifted_positions = runner.model(batch._replace(positions=batch.positions + 1))
        for layer in runner.model.layers:
            layer.gelu_approximate = "tanh"
        tanh = runner.model(batch)
    for wrong in (unmasked, shifted_positions, tanh):
        assert (wrong - expected).abs().max() > 1e-3  # 100x the tolerance


def test_an_encoder_only_embeds(tmp_path: Path) -> None:
    _tiny_bert(tmp_path)
    runner = load_runner(tmp_path, dtype="float32")
    assert runner.blocks is None and runner.cache is None
    with pytest.raises(Exception, match="is an encoder"):
        runner.prefill_logits([2, 5, 3])
    with pytest.raises(ValueError, match="exceeds the context size of 40"):
        runner.embed([[5] * 41])
    with pytest.raises(ValueError, match="out of range"):
        runner.embed([[5, 64]])
    with pytest.raises(ValueError, match="quant 'int8' is for decoders"):
        load_runner(tmp_path, quant="int8")
