"""Which reasoning format a model uses: from its chat template, its vocabulary, or the operator's choice."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.tokenizer.tokenizer import Tokenizer
from server.reasoning.formats import REASONING_FORMATS, choose_format, detect_format, opens_thinking
from tests.support.tiny_models import build_tiny_model


def encoder(tokenizer: Tokenizer):
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("qwen3_thinking", tmp_path_factory.mktemp("t")).safetensors_dir


@pytest.fixture(scope="module")
def thinking_tokenizer(thinking_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained_dir(thinking_dir)


def test_a_vocabulary_with_the_tags_as_tokens_is_detected(thinking_tokenizer: Tokenizer) -> None:
    fmt = detect_format(None, encoder(thinking_tokenizer))
    assert fmt is not None and (fmt.start, fmt.end) == ("<think>", "</think>")


def test_a_template_that_writes_the_closing_tag_is_detected() -> None:
    fmt = detect_format("{{ '[THINK]' }}...{{ '[/THINK]' }}", lambda text: [1, 2])
    assert fmt is REASONING_FORMATS["mistral"]


def test_a_model_without_tags_has_no_format(smollm) -> None:
    tokenizer = smollm.tokenizer
    assert detect_format(tokenizer.chat_template, encoder(tokenizer)) is None
    assert choose_format("auto", tokenizer.chat_template, encoder(tokenizer)) is None


def test_the_operators_choice_wins(thinking_tokenizer: Tokenizer) -> None:
    assert choose_format("none", thinking_tokenizer.chat_template, encoder(thinking_tokenizer)) is None
    assert choose_format("seed_oss", None, lambda text: [1, 2]) is REASONING_FORMATS["seed_oss"]


def test_harmony_is_refused_for_a_vocabulary_without_its_control_tokens(thinking_tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match=r"--reasoning-parser harmony: the vocabulary lacks harmony's control tokens"):
        choose_format("harmony", thinking_tokenizer.chat_template, encoder(thinking_tokenizer))


@pytest.mark.parametrize("tail, inside", [("<|im_start|>assistant\n<think>\n", True),
                                          ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
                                          ("<|im_start|>assistant\n", False)])
def test_a_prompt_that_opens_the_thinking(tail: str, inside: bool) -> None:
    assert opens_thinking(tail, REASONING_FORMATS["qwen3"]) is inside


def test_emberserve_show_names_the_format_serving_would_pick(thinking_dir: Path) -> None:
    from server.generator.model_card import show_model

    card = show_model(str(thinking_dir))
    assert card.reasoning is not None and (card.reasoning.start, card.reasoning.end) == ("<think>", "</think>")
    assert "thinking between <think> and </think>" in card.text()
    assert show_model("smollm2-135m").reasoning is None
