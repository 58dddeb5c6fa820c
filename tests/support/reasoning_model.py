"""A tiny random reasoning model behind a real server, for the e2e tests of thinking in every API.

The model is a tiny random Qwen3 whose vocabulary has `<think>` and `</think>`. Served with `R1_TEMPLATE` (our own
template that, as DeepSeek-R1's does, opens the thinking in the generation prompt), everything it writes is
thinking until a budget forces the closing tag: a random model's output, made deterministic by greedy decoding.
Served with its own template (Qwen3's, reduced), `enable_thinking: false` closes the thinking in the prompt.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.server_process import ServerProcess, start_server, stop_server
from tests.support.tiny_models import build_tiny_model

# Opens the thinking in the generation prompt; an assistant turn given back with its thinking (`reasoning_content`)
# is written with it, so that a test sees the thinking reach the template in the prompt's length.
R1_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.reasoning_content is defined and message.reasoning_content %}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- (message.content or '') + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}")
ASK = [{"role": "user", "content": "The quick brown fox"}]


def thinking_model(where: Path) -> Path:
    """The tiny reasoning model's safetensors directory, built under `where`."""
    return build_tiny_model("qwen3_thinking", where).safetensors_dir


@contextmanager
def serving(tmp: Path, model: Path, *args: str) -> Iterator[ServerProcess]:
    """The model served (float32, for outputs that repeat exactly) with `args`, stopped on exit."""
    srv = start_server(tmp, "--model", str(model), "--dtype", "float32", *args)
    try:
        yield srv
    finally:
        stop_server(srv)


@contextmanager
def serving_r1(tmp: Path, model: Path) -> Iterator[ServerProcess]:
    """The model with `R1_TEMPLATE` (--chat-template): its output starts inside the thinking."""
    template = tmp / "r1.jinja"
    template.write_text(R1_TEMPLATE)
    with serving(tmp, model, "--chat-template", str(template)) as srv:
        yield srv
