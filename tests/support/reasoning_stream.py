"""A streamed chat completion of a reasoning model, read as a client reads it: the thinking (`delta.reasoning`, with
`delta.reasoning_content` the same), the answer, and the order in which they came."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def read_reasoning_stream(stream: Iterable[Any]) -> tuple[str, str, list[str]]:
    """(thinking, answer, the kind of each delta in order: "thinking" or "answer")."""
    thinking, content, order = "", "", []
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        if extra.get("reasoning"):
            assert extra["reasoning_content"] == extra["reasoning"]
            thinking += extra["reasoning"]
            order.append("thinking")
        if delta.content:
            content += delta.content
            order.append("answer")
    return thinking, content, order
