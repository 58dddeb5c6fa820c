"""A tiny random harmony model (gpt-oss's tokens and chat template) behind a real server, for the e2e tests of the
harmony format.

The model is `tests.support.tiny_models`' "gpt_oss_harmony": random weights, a vocabulary with harmony's control
tokens as special tokens, gpt-oss's own chat template. A random model writes no harmony by itself, so the tests
make it, as the reasoning tests do:
- served with `ANALYSIS_TEMPLATE` (gpt-oss's template whose generation prompt also opens the analysis channel, as
  a template that opens the thinking does), everything it writes is thinking until a budget forces the end of the
  analysis and the final channel's header; the control tokens banned by `logit_bias` (except where forced), the
  answer runs to max_tokens;
- served with its own template, a forced tool call (tool_choice naming a function) is written under the call's
  grammar: the header, the arguments under their schema, <|call|>.
"""
from __future__ import annotations

from pathlib import Path

from tests.support.tiny_models import GPT_OSS_TEMPLATE_PATH, build_tiny_model

CONTROL_TOKENS = ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                  "<|end|>", "<|message|>", "<|call|>")
GENERATION_PROMPT = "{%- if add_generation_prompt -%}\n<|start|>assistant\n"
ANALYSIS_TEMPLATE = GPT_OSS_TEMPLATE_PATH.read_text(encoding="utf-8").replace(
    GENERATION_PROMPT, "{%- if add_generation_prompt -%}\n<|start|>assistant<|channel|>analysis<|message|>\n")
assert ANALYSIS_TEMPLATE != GPT_OSS_TEMPLATE_PATH.read_text(encoding="utf-8")


def harmony_model(where: Path) -> Path:
    """The tiny harmony model's safetensors directory, built under `where`."""
    return build_tiny_model("gpt_oss_harmony", where).safetensors_dir


def analysis_template(where: Path) -> Path:
    """`ANALYSIS_TEMPLATE` as a file, for --chat-template."""
    path = where / "harmony-analysis.jinja"
    path.write_text(ANALYSIS_TEMPLATE, encoding="utf-8")
    return path
