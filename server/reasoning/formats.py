"""Reasoning formats: the tag pairs models write their thinking between, and which one a model uses.

A new format is one line of `REASONING_FORMATS`. `--reasoning-parser auto` (the default) picks the first format
whose closing tag the chat template writes, or whose both tags are single tokens of the vocabulary; `none` turns
reasoning off (the thinking stays in the answer's text, as before).

"harmony" (gpt-oss) is no tag pair but messages on channels (server/reasoning/harmony.py): its "tags" are where the
thinking (the analysis channel) starts and the answer (the final channel) follows, and it is chosen by its chat
template only, whose control tokens must be single tokens of the vocabulary.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str    # the tag that opens the thinking
    end: str      # the tag that closes it; the answer follows
    models: str   # who writes it (documentation)
    kind: Literal["tags", "harmony"] = "tags"


REASONING_FORMATS: dict[str, ReasoningFormat] = {f.name: f for f in (
    ReasoningFormat("deepseek_r1", "<think>", "</think>", "DeepSeek-R1 and its distills, QwQ"),
    ReasoningFormat("qwen3", "<think>", "</think>", "Qwen3 (thinking and hybrid models)"),
    ReasoningFormat("mistral", "[THINK]", "[/THINK]", "Magistral"),
    ReasoningFormat("seed_oss", "<seed:think>", "</seed:think>", "Seed-OSS"),
    ReasoningFormat("harmony", "<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>final<|message|>",
                    "gpt-oss (the harmony format: analysis, commentary and final channels)", kind="harmony"),
)}
# harmony's control tokens, every one a single special token of a harmony vocabulary
HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
AUTO, NONE = "auto", "none"
ReasoningParserName = Literal[AUTO, NONE, *REASONING_FORMATS]  # type: ignore[valid-type]


def detect_format(template: str | None, encode: Callable[[str], Sequence[int]]) -> ReasoningFormat | None:
    """The format a model uses, from its chat template's source and its vocabulary (`encode`: text to its ids,
    no special tokens added); None when neither shows one."""
    for fmt in REASONING_FORMATS.values():
        if template and fmt.end in template and (fmt.kind == "tags" or speaks_harmony(encode)):
            return fmt
    for fmt in REASONING_FORMATS.values():
        if fmt.kind == "tags" and len(encode(fmt.start)) == 1 and len(encode(fmt.end)) == 1:
            return fmt
    return None


def speaks_harmony(encode: Callable[[str], Sequence[int]]) -> bool:
    """Whether every harmony control token is one token of the vocabulary."""
    return all(len(encode(t)) == 1 for t in HARMONY_TOKENS)


def choose_format(parser: str, template: str | None, encode: Callable[[str], Sequence[int]]) -> ReasoningFormat | None:
    """The format `--reasoning-parser` names (auto: detected; none: None)."""
    if parser == NONE:
        return None
    if parser == AUTO:
        return detect_format(template, encode)
    fmt = REASONING_FORMATS[parser]
    if fmt.kind == "harmony" and not speaks_harmony(encode):
        raise ValueError(f"--reasoning-parser harmony: the vocabulary lacks harmony's control tokens "
                         f"({' '.join(HARMONY_TOKENS)})")
    return fmt


def opens_thinking(prompt_tail: str, fmt: ReasoningFormat) -> bool:
    """Whether a prompt ending in `prompt_tail` leaves the model inside its thinking: a template that writes the
    opening tag itself (DeepSeek-R1's) makes the output start there."""
    return prompt_tail.rfind(fmt.start) > prompt_tail.rfind(fmt.end)
