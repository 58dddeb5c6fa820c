"""Chat templates: Jinja rendering the way Hugging Face transformers does it, plus fallbacks for models without one."""
from __future__ import annotations

import functools
import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "fallback_chat_template"]

# Gemma 3's official layout: no system role, so the system prompt opens the first user turn.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = (messages[0]['content'] or '') + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}"
    "{% set first_user_prefix = '' %}"
    "{% set loop_messages = messages %}"
    "{% endif %}"
    "{% for message in loop_messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else 'user' %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ (message['content'] or '') | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

PLAIN_TEMPLATE = (
    "{% for message in messages %}"
    "{% if not loop.first %}{{ '\n\n' }}{% endif %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] or '' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '\n\nAssistant:' if messages else 'Assistant:' }}{% endif %}"
)


def fallback_chat_template(has_token: Callable[[str], bool]) -> str:
    """The template for a model that ships none: Gemma turns, ChatML, or plain text, by what the vocabulary has."""
    if has_token("<start_of_turn>") and has_token("<end_of_turn>"):
        return GEMMA_TEMPLATE
    if has_token("<|im_start|>") and has_token("<|im_end|>"):
        return CHATML_TEMPLATE
    return PLAIN_TEMPLATE


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker) renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore attributes, as transformers' does, so templates cannot reach internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which templates do not expect.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env


def _iterates_content(source: str) -> bool:
    """Whether the template loops over `message['content']` itself, i.e. understands OpenAI content parts."""
    for loop in _environment().parse(source).find_all(jinja2.nodes.For):
        node = loop.iter
        while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) and node.node is not None:
            node = node.node
        if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const):
            if node.arg.value == "content":
                return True
        elif isinstance(node, jinja2.nodes.Getattr) and node.attr == "content":
            return True
        elif isinstance(node, jinja2.nodes.Name) and node.name == "content":
            return True
    return False


def _flatten_content(content: Any) -> Any:
    """OpenAI content parts `[{"type": "text", "text": ...}]` as one string; strings and None pass through."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"unsupported message content part {kind!r}: only text parts are supported")
    return "\n".join(texts)


def _final_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        texts = [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        if not texts:
            raise ValueError("continue_final_message needs a final message with text content")
        return texts[-1]
    if not isinstance(content, str):
        raise ValueError("continue_final_message needs a final message with text content")
    return content


class ChatTemplate:
    """A chat template compiled once; `render` turns a conversation into the prompt text."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._template = _environment().from_string(source)
        self._keeps_parts = _iterates_content(source)

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, **variables: Any) -> str:
        """The prompt text; `variables` (bos_token, tools, ...) are visible to the template."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are mutually exclusive")
        if not self._keeps_parts:
            messages = [{**m, "content": _flatten_content(m["content"])} if "content" in m else m for m in messages]
        context = {"tools": None, "documents": None, **variables}
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
        if continue_final_message and messages:
            text = _cut_after_final_message(text, _final_text(messages[-1]))
        return text


def _cut_after_final_message(text: str, final: str) -> str:
    """Drop what the template appends after the last message (its end-of-turn), as transformers does."""
    stripped = final.strip()
    if stripped not in text:
        raise ValueError("continue_final_message: the final message does not appear in the rendered chat")
    at = text.rindex(stripped)
    if text[at:at + len(final.lstrip())] == final:
        return text[:at + len(final.lstrip())]
    return text[:at + len(stripped)]
