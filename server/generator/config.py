"""The values of an in-process generation (`GenerationConfig`), what a call gives back, and the request it makes."""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from pydantic import ValidationError


from server.errors import APIError
from server.scheduling.generation import Generation
from server.api.openai.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, StructuredRequest

# What a prompt may be: text (a completion), token ids, or chat messages (the model's chat template applies).
Prompt = str | Sequence[int] | Sequence[Mapping[str, Any] | ChatMessage]


class GenerationError(Exception):
    """What the HTTP API would have answered with an error: the message, its status, the field at fault, the code."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code


@contextmanager
def as_generation_errors() -> Iterator[None]:
    """APIErrors and request validation errors, raised as GenerationError."""
    try:
        yield
    except APIError as e:
        raise GenerationError(e.message, e.status, e.param, e.code) from None
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ())) or None
        message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        raise GenerationError(f"{param}: {message}" if param else message, 400, param) from None


@dataclass(frozen=True)
class GenerationConfig:
    """Generation values of a generator or one call; None leaves a value out (the preset's, the generator's preset,
    the model's default applies, in that order; max_tokens left out everywhere: until an end token or the context
    is full). `preset` names a profile of server/config/presets.py."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    stop: tuple[str, ...] | None = None
    ignore_eos: bool | None = None
    seed: int | None = None
    preset: str | None = None
    # Structured outputs, as the chat and completions APIs take them: `response_format` {"type": "json_object"} or
    # {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}; `structured_outputs` (vLLM's) exactly
    # one of {"json": schema, "regex": ..., "choice": [...], "grammar": ..., "json_object": true}.
    response_format: Mapping[str, Any] | None = None
    structured_outputs: Mapping[str, Any] | None = None

    @classmethod
    def of(cls, values: GenerationConfig | Mapping[str, Any] | None) -> GenerationConfig:
        """A config from a mapping of its field names (a TypeError-free GenerationError for unknown ones)."""
        if values is None:
            return cls()
        if isinstance(values, GenerationConfig):
            return values
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise GenerationError(f"unknown generation settings: {', '.join(unknown)}; known: "
                                  f"{', '.join(f.name for f in fields(cls))}", param=unknown[0])
        stop = values.get("stop")
        return cls(**{**values, "stop": (stop,) if isinstance(stop, str) else None if stop is None else tuple(stop)})

    def merged(self, overrides: GenerationConfig) -> GenerationConfig:
        """This config with the values `overrides` sets replacing ours."""
        return replace(self, **{k: v for k, v in asdict(overrides).items() if v is not None})

    def request_fields(self) -> dict[str, Any]:
        """The values set, as request fields (a budget left out is the rest of the context, not completions' 16)."""
        out = {k: v for k, v in asdict(self).items() if v is not None}
        if "stop" in out:
            out["stop"] = [out["stop"]] if isinstance(out["stop"], str) else list(out["stop"])
        out.setdefault("max_tokens", None)
        return out


@dataclass(frozen=True)
class StreamedToken:
    """One generated token: its id, the text it adds (empty while a character or a possible stop string is still
    incomplete; that text comes with a later token), its logprob under the model, and the finish reason on the
    last one."""

    id: int
    text: str
    logprob: float
    finish_reason: str | None = None


class GeneratedText(str):
    """A finished generation: its text, as a `str` (`==`, `in`, slicing, `json.dumps` treat it as the plain text),
    carrying as read-only attributes the tokens (an end token that stopped it included), their logprobs, why it
    ended ("stop": an end token or stop string; "length": max_tokens or the context), the token counts and the
    values it ran with (`config`: every sampling value as resolved, the budget, the preset)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    config: GenerationConfig

    def __new__(cls, text: str, token_ids: list[int], logprobs: list[float], finish_reason: str,
                prompt_tokens: int, cached_tokens: int, config: GenerationConfig) -> GeneratedText:
        self = super().__new__(cls, text)
        # str subclasses cannot have __slots__ of their own: the attributes live in the instance dict, written
        # once here (__setattr__ refuses later writes, as str itself is immutable).
        self.__dict__.update(token_ids=token_ids, logprobs=logprobs, finish_reason=finish_reason,
                             prompt_tokens=prompt_tokens, cached_tokens=cached_tokens, config=config)
        return self

    @property
    def text(self) -> str:
        """The text as a plain `str`."""
        return str(self)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"GeneratedText is immutable: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"GeneratedText is immutable: cannot delete {name!r}")

    def __reduce__(self) -> tuple[Any, ...]:
        # pickle and copy rebuild it with its attributes (str's own reduction would pass the text alone)
        return (GeneratedText, (str(self), self.token_ids, self.logprobs, self.finish_reason, self.prompt_tokens,
                                self.cached_tokens, self.config))


def ran_with(gen: Generation, preset: str | None, config: GenerationConfig | None = None) -> GenerationConfig:
    """The values `gen` ran with; its output constraint as `config` (the call's) gave it."""
    p = gen.params
    return GenerationConfig(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
                            repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
                            frequency_penalty=p.frequency_penalty, max_tokens=gen.max_tokens,
                            min_tokens=gen.min_tokens, stop=tuple(gen.stop), ignore_eos=gen.ignore_eos, seed=p.seed,
                            preset=preset, response_format=config.response_format if config else None,
                            structured_outputs=config.structured_outputs if config else None)


def generation_request(model: str, prompt: Prompt, config: GenerationConfig,
                       stream: bool = False) -> StructuredRequest:
    """The request the HTTP API would get for this call, validated by its models (GenerationError otherwise): a
    completion for text or token ids, a chat completion for messages."""
    body = {"model": model, **config.request_fields(), "stream": stream}
    with as_generation_errors():
        if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
            return CompletionRequest.model_validate(
                {**body, "prompt": prompt if isinstance(prompt, str) else list(prompt)})
        messages = [m.model_dump(exclude_none=True) if isinstance(m, ChatMessage) else dict(m) for m in prompt]
        return ChatCompletionRequest.model_validate({**body, "messages": messages})
