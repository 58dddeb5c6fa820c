"""`show_model` (`emberserve show`): what a model is and how emberserve will talk to it, from its files alone: its
facts (`ModelInfo`), architecture, the chat template chats are rendered with and where it comes from, the sampling
defaults it comes with, the reasoning format `--reasoning-parser auto` finds for it (server/reasoning/formats.py),
and the tool-call format its template was trained on (server/api/openai/tool_calls.py)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from engine import KNOWN_MODELS
from engine.weights.summary import generation_defaults, model_config, model_tokenizer, parameter_size, read_summary

from server.api.openai.tool_calls import tool_format
from server.api.tool_parser import ToolFormatName
from server.config.model_catalog import ModelInfo, model_info
from server.reasoning.formats import ReasoningFormat, detect_format


@dataclass(frozen=True)
class ModelCard:
    """A model as `emberserve show` describes it. `chat_template` is None for an embedding model (it has no chats);
    `template_source`: the model's files, the registry (a known model's own choice), or emberserve's fallback for
    a model that ships none (ChatML, Gemma turns or plain text, by its vocabulary)."""

    info: ModelInfo
    config: dict[str, Any]                 # the architecture: ModelConfig's (or EncoderConfig's) fields
    generation_defaults: dict[str, Any]    # the sampling values requests fall back on
    chat_template: str | None
    template_source: Literal["model", "registry", "fallback"] | None
    reasoning: ReasoningFormat | None      # how its thinking is told from its answer (auto); None: it has none
    tool_format: ToolFormatName | None     # how tool calls are written: hermes, llama3, generic or harmony

    def text(self) -> str:
        """The card for the terminal."""
        info = self.info
        facts = [("name", info.name), ("path", str(info.path)), ("description", info.description),
                 ("family", f"{info.family} ({info.kind})"),
                 ("parameters", "-" if info.parameters is None else parameter_size(info.parameters)),
                 ("quantization", info.quantization or "-"), ("context", str(info.context_length or "-")),
                 ("size", "-" if info.size_bytes is None else f"{info.size_bytes / (1 << 20):.1f} MiB"),
                 ("architecture", ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"
                                            for k, v in self.config.items()
                                            if k != "family" and isinstance(v, (int, float, str, bool)))),
                 ("generation", ", ".join(f"{k} {v}" for k, v in self.generation_defaults.items())
                  or "none: a request's own values, or the server's")]
        if self.chat_template is not None:
            fmt = self.reasoning
            facts += [("reasoning", "none found" if fmt is None else
                       f"{fmt.name}: thinking between {fmt.start} and {fmt.end}, apart from the answer"),
                      ("tools", f"{self.tool_format} tool-call format"),
                      ("template", f"from the {self.template_source}" if self.template_source != "fallback"
                       else "none in the files: emberserve's fallback")]
        width = max(len(key) for key, _ in facts)
        lines = [f"{key.ljust(width)}  {value}" for key, value in facts]
        if self.chat_template is not None:
            lines += ["", self.chat_template]
        return "\n".join(lines)


def show_model(name: str) -> ModelCard:
    """The card of the model `name` (a known name, a pulled Hugging Face name, a path); ValueError when there is no
    such model or it is not installed."""
    info = model_info(name)
    if info.path is None:
        raise ValueError(f"{name} is not installed; run: {info.install}")
    known = KNOWN_MODELS.get(name)
    config = model_config(info.path)
    template = source = tools = reasoning = None
    if info.generator:
        tokenizer = model_tokenizer(info.path, known)
        template = tokenizer.chat_template
        # what `--reasoning-parser auto` picks when the model is served (server/scheduling/loading.py)
        reasoning = detect_format(template, lambda text: tokenizer.encode(text, add_special_tokens=False))
        source = "registry" if known is not None and known.chat_template is not None else \
            "model" if read_summary(info.path).has_chat_template else "fallback"
        tools = tool_format(template)
    return ModelCard(info=info, config=dataclasses.asdict(config),
                     generation_defaults=generation_defaults(info.path, known), chat_template=template,
                     template_source=source, reasoning=reasoning,
                     tool_format=tools)

