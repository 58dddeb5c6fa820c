"""`Generator`: the engine from Python without HTTP, on the server's own worker pool, scheduler and sampler.

A call builds the request the HTTP API would get (a completion for text or token ids, a chat completion for a
list of messages), validated by the same pydantic models, with its sampling values resolved by the same code
(`OpenAIServing.sampling_params`: the call's values, then its preset, the generator's preset, the model's
defaults), and submits a `Generation` to the worker pool. Many concurrent calls from one event loop are batched
together by the worker's scheduler, exactly as concurrent HTTP requests are; a call or stream that is cancelled or
closed early cancels its generation, whose KV blocks the worker frees at its next step.

    async with await Generator.builder("smollm2-135m").cpu().precise().build() as gen:
        print((await gen.generate("The capital of France is")).text)
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import aclosing, contextmanager
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from engine import Runner

from server.api.app import start_serving
from server.errors import APIError
from server.scheduling.generation import ChoiceDelta, Generation, GenerationDone, GenerationFailed
from server.api.metrics import ServerMetrics
from server.api.openai.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, OpenAIRequest
from server.api.serving import ModelState, OpenAIServing, check_token_ids, request_id
from server.api.openai.chat import chat_prompt_ids
from server.config.settings import Settings

if TYPE_CHECKING:
    from server.generator.builder import GeneratorBuilder

# What a prompt may be: text (a completion), token ids, or chat messages (the model's chat template applies).
Prompt = str | Sequence[int] | Sequence[Mapping[str, Any] | ChatMessage]


class GenerationError(Exception):
    """What the HTTP API would have answered with an error: the message, its status, the field at fault, the code."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code


@contextmanager
def _as_generation_errors() -> Iterator[None]:
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
    is full). `preset` names a profile of server/presets.py."""

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


@dataclass(frozen=True)
class GeneratedText:
    """A finished generation: the text, the tokens (an end token that stopped it included), their logprobs, why it
    ended ("stop": an end token or stop string; "length": max_tokens or the context), the token counts and the
    values it ran with (`config`: every sampling value as resolved, the budget, the preset)."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    config: GenerationConfig

    def __str__(self) -> str:
        return self.text


def _ran_with(gen: Generation, preset: str | None) -> GenerationConfig:
    p = gen.params
    return GenerationConfig(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
                            repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
                            frequency_penalty=p.frequency_penalty, max_tokens=gen.max_tokens,
                            min_tokens=gen.min_tokens, stop=tuple(gen.stop), ignore_eos=gen.ignore_eos, seed=p.seed,
                            preset=preset)


def generation_request(model: str, prompt: Prompt, config: GenerationConfig, stream: bool = False) -> OpenAIRequest:
    """The request the HTTP API would get for this call, validated by its models (GenerationError otherwise): a
    completion for text or token ids, a chat completion for messages."""
    body = {"model": model, **config.request_fields(), "stream": stream}
    with _as_generation_errors():
        if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
            return CompletionRequest.model_validate(
                {**body, "prompt": prompt if isinstance(prompt, str) else list(prompt)})
        messages = [m.model_dump(exclude_none=True) if isinstance(m, ChatMessage) else dict(m) for m in prompt]
        return ChatCompletionRequest.model_validate({**body, "messages": messages})


class Generator:
    """A model served in-process. Build one with `Generator.builder(name)...build()`; close it (or use it as an
    async context manager) to stop its worker threads."""

    def __init__(self, state: ModelState, config: GenerationConfig | None = None) -> None:
        self.state = state
        self.config = config or GenerationConfig()
        self.serving = OpenAIServing(state, ServerMetrics(state.pool.stats))
        self._open: set[Generation] = set()
        self._closed = False

    @staticmethod
    def builder(model: str) -> GeneratorBuilder:
        """A builder for a known model name (see `available_models()`), or a .gguf file or safetensors directory."""
        from server.generator.builder import GeneratorBuilder

        return GeneratorBuilder(model)

    @classmethod
    def from_runner(cls, runner: Runner, config: GenerationConfig | Mapping[str, Any] | None = None,
                    **settings: Any) -> Generator:
        """A generator serving a runner already loaded (its worker owns the runner until `close`); `settings`:
        any server settings (`preset`, `max_running`, ...)."""
        if runner.is_encoder:
            raise ValueError(f"{runner.name} is an encoder: it embeds, it does not generate")
        values = Settings(**{"model": runner.name, "device": str(runner.device), **settings})
        # No output grammars in this API (yet): the grammar engine's vocabulary is not built for nothing.
        return cls(start_serving(values, [runner], prepare_grammars=False), GenerationConfig.of(config))

    # ---- what is served ----
    @property
    def model_name(self) -> str:
        return self.state.model_id

    @property
    def device(self) -> str:
        return str(self.state.runner.device)

    @property
    def context_size(self) -> int:
        return self.state.runner.context_size

    @property
    def vocab_size(self) -> int:
        return self.state.runner.vocab_size

    @property
    def tokenizer(self) -> Any:
        return self.state.runner.tokenizer

    @property
    def generation_config(self) -> GenerationConfig:
        """The values a call without overrides runs with: the generator's own, its preset's and the model's
        defaults resolved (max_tokens None: until an end token or the context is full)."""
        req = self._request("x", self.config, stream=False)
        params = self.serving.sampling_params(req, False, 0)
        budget = req.max_tokens if req.max_tokens is not None else self.serving.defaults(req).get("max_tokens")
        return GenerationConfig(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                min_p=params.min_p, repetition_penalty=params.repetition_penalty,
                                presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
                                max_tokens=budget, min_tokens=req.min_tokens, stop=tuple(req.stop),
                                ignore_eos=req.ignore_eos, seed=params.seed, preset=self._preset_name(req))

    def _preset_name(self, req: OpenAIRequest) -> str | None:
        """The preset a request runs under: its own, else the generator's."""
        return req.preset or (self.state.preset.name if self.state.preset is not None else None)

    # ---- generating ----
    async def generate(self, prompt: Prompt) -> GeneratedText:
        """Generate from `prompt` with the generator's values."""
        return await self.generate_with_config(prompt, None)

    async def generate_with_config(self, prompt: Prompt,
                                   overrides: GenerationConfig | Mapping[str, Any] | None) -> GeneratedText:
        """Generate from `prompt`; the values `overrides` sets replace the generator's for this call."""
        gen, req = await self._start(prompt, overrides, stream=False)
        text, tokens, logprobs = [], [], []
        finish, done = None, None
        async with aclosing(self._events(gen)) as events:
            async for event in events:
                if isinstance(event, ChoiceDelta):
                    text.append(event.text)
                    tokens += event.tokens
                    logprobs += [lp.logprob for lp in event.logprobs or []]
                    finish = event.finish_reason or finish
                elif isinstance(event, GenerationDone):
                    done = event
        assert done is not None and finish is not None  # _events ends with GenerationDone or raises
        return GeneratedText("".join(text), tokens, logprobs, finish, done.prompt_tokens, done.cached_tokens,
                             _ran_with(gen, self._preset_name(req)))

    async def stream(self, prompt: Prompt, overrides: GenerationConfig | Mapping[str, Any] | None = None
                     ) -> AsyncIterator[StreamedToken]:
        """The tokens of a generation as the worker makes them. Leaving early (break, `aclose()`, a cancelled
        task) cancels the generation; wrap it in `contextlib.aclosing` for that to happen at once."""
        gen, _ = await self._start(prompt, overrides, stream=True)
        async with aclosing(self._events(gen)) as events:
            async for event in events:
                if not isinstance(event, ChoiceDelta):
                    continue
                last = len(event.tokens) - 1
                for i, (token, lp) in enumerate(zip(event.tokens, event.logprobs or [])):
                    # A delta's text is what its tokens completed: it goes with the last of them.
                    yield StreamedToken(token, event.text if i == last else "", lp.logprob,
                                        event.finish_reason if i == last else None)

    async def stream_text(self, prompt: Prompt, overrides: GenerationConfig | Mapping[str, Any] | None = None
                          ) -> AsyncIterator[str]:
        """The text of a generation in pieces as it comes (no empty pieces)."""
        async with aclosing(self.stream(prompt, overrides)) as tokens:
            async for token in tokens:
                if token.text:
                    yield token.text

    # ---- the request path ----
    def _request(self, prompt: Prompt, config: GenerationConfig, stream: bool) -> OpenAIRequest:
        return generation_request(self.model_name, prompt, config, stream)

    def _prompt_ids(self, req: OpenAIRequest) -> list[int]:
        with _as_generation_errors():
            if isinstance(req, ChatCompletionRequest):
                return chat_prompt_ids(self.state, req.messages, add_generation_prompt=True)
            assert isinstance(req, CompletionRequest)
            if isinstance(req.prompt, str):
                return self.tokenizer.encode(req.prompt)
            check_token_ids(req.prompt, self.vocab_size, "prompt")
            return list(req.prompt)

    async def _start(self, prompt: Prompt, overrides: GenerationConfig | Mapping[str, Any] | None,
                     stream: bool) -> tuple[Generation, OpenAIRequest]:
        """The call's Generation, submitted to the worker pool."""
        if self._closed:
            raise GenerationError("this generator is closed", 503, code="closed")
        arrival = time.perf_counter()
        req = self._request(prompt, self.config.merged(GenerationConfig.of(overrides)), stream)
        ids = await asyncio.to_thread(self._prompt_ids, req)  # a chat template or a long text: off the loop
        with _as_generation_errors():
            params = self.serving.sampling_params(req, True, 0)
            budget = self.serving.completion_budget(req, len(ids), "max_tokens")
            gen = self.serving.new_generation(req, ids, params, budget, request_id("gen"), arrival)
            self.serving.submit([gen])
        return gen, req

    async def _events(self, gen: Generation) -> AsyncIterator[Any]:
        """The generation's events to its end; leaving early cancels it (serving.events does)."""
        self._open.add(gen)
        try:
            async with aclosing(self.serving.events([gen])) as events:
                with _as_generation_errors():
                    async for _, event in events:
                        yield event
        finally:
            self._open.discard(gen)

    # ---- closing ----
    async def close(self) -> None:
        """End the generations in flight (their callers get a GenerationError) and stop the worker threads."""
        if self._closed:
            return
        self._closed = True
        for gen in list(self._open):
            gen.cancel()
            gen.emit(GenerationFailed(503, "the generator was closed", "closed"))
        await asyncio.to_thread(self.state.pool.stop)

    async def __aenter__(self) -> Generator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
