"""`Generator`: the engine from Python without HTTP, on the server's own worker pool, scheduler and sampler.

A call builds the request the HTTP API would get (a completion for text or token ids, a chat completion for a
list of messages), validated by the same pydantic models, with its sampling values resolved by the same code
(`OpenAIServing.sampling_params`: the call's values, then its preset, the generator's preset, the model's
defaults), and submits a `Generation` to the worker pool. Many concurrent calls from one event loop are batched
together by the worker's scheduler, exactly as concurrent HTTP requests are; a call or stream that is cancelled or
closed early cancels its generation, whose KV blocks the worker frees at its next step.

    async with await Generator.builder("smollm2-135m").cpu().precise().build() as gen:
        answer = await gen.generate([{"role": "user", "content": "What is the capital of France?"}])
        print(answer, answer.finish_reason)  # a str, with the tokens, logprobs, finish reason and config on it
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Iterator, Mapping, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError

from engine import KNOWN_MODELS, Runner
from engine.registry import model_path
from engine.weights import no_progress

from server.api.metrics import ServerMetrics
from server.api.openai.preparation import OutputPlan, chat_prompt_ids
from server.api.openai.protocol import ChatCompletionRequest, CompletionRequest, OpenAIRequest, StructuredRequest
from server.api.openai.serving import OpenAIServing, check_token_ids, request_id
from server.config.model_catalog import is_generator_model
from server.config.presets import get_preset
from server.config.model_store import ensure_model
from server.config.settings import RENAMED, SELF_DRAFTS, Settings, env_name, flag_name
from server.generator.config import (GeneratedText, GenerationConfig, GenerationError, Prompt, StreamedToken,
                                     as_generation_errors, generation_request, ran_with)
from server.scheduling.generation import ChoiceDelta, Generation, GenerationDone, GenerationFailed
from server.scheduling.loading import load_model, start_serving, stop_workers
from server.scheduling.model_state import ModelState
from server.scheduling.threads import in_own_thread

T = TypeVar("T")
Overrides = GenerationConfig | Mapping[str, Any] | None
_END = object()


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
        """A builder for a known model name (`available_models()`; `suggested_models()`: the installed chat models),
        a .gguf file or safetensors directory, or a Hugging Face name (`owner/repo:QUANT`, `owner/repo`) pulled
        into the local cache (`pull_model`, or the builder's `pull()`)."""
        return GeneratorBuilder(model)

    @classmethod
    def from_runner(cls, runner: Runner, config: GenerationConfig | Mapping[str, Any] | None = None,
                    **settings: Any) -> Generator:
        """A generator serving a runner already loaded (its worker owns the runner until `close`); `settings`:
        any server settings (`preset`, `max_running`, ...)."""
        if runner.is_encoder:
            raise ValueError(f"{runner.name} is an encoder: it embeds, it does not generate")
        values = Settings(**{"model": runner.name, "device": str(runner.device), **settings})
        # The grammar engine's vocabulary is built on the first call with an output constraint, not at start.
        return cls(start_serving(values, [runner], prepare_grammars=False), GenerationConfig.of(config))

    # ---- what is served ----
    @property
    def model_name(self) -> str:
        return self.state.model_id

    @property
    def device(self) -> str:
        return str(self.state.model.device)

    @property
    def context_size(self) -> int:
        return self.state.model.context_size

    @property
    def vocab_size(self) -> int:
        return self.state.model.vocab_size

    @property
    def tokenizer(self) -> Any:
        return self.state.model.tokenizer

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
                                ignore_eos=req.ignore_eos, seed=params.seed, preset=self._preset_name(req),
                                response_format=self.config.response_format,
                                structured_outputs=self.config.structured_outputs)

    def _preset_name(self, req: OpenAIRequest) -> str | None:
        """The preset a request runs under: its own, else the generator's."""
        return req.preset or (self.state.preset.name if self.state.preset is not None else None)

    # ---- generating ----
    async def generate(self, prompt: Prompt) -> GeneratedText:
        """Generate from `prompt` with the generator's values: the text, a `str` carrying the tokens, logprobs,
        finish reason and values it ran with (`GeneratedText`)."""
        return await self.generate_with_config(prompt, None)

    async def generate_with_config(self, prompt: Prompt,
                                   overrides: GenerationConfig | Mapping[str, Any] | None) -> GeneratedText:
        """Generate from `prompt`; the values `overrides` sets replace the generator's for this call."""
        gen, req, config = await self._start(prompt, overrides, stream=False)
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
                             ran_with(gen, self._preset_name(req), config))

    async def stream(self, prompt: Prompt, overrides: GenerationConfig | Mapping[str, Any] | None = None
                     ) -> AsyncIterator[StreamedToken]:
        """The tokens of a generation as the worker makes them. Leaving early (break, `aclose()`, a cancelled
        task) cancels the generation; wrap it in `contextlib.aclosing` for that to happen at once."""
        gen, _, _ = await self._start(prompt, overrides, stream=True)
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
    def _request(self, prompt: Prompt, config: GenerationConfig, stream: bool) -> StructuredRequest:
        return generation_request(self.model_name, prompt, config, stream)

    def _prompt_ids(self, req: StructuredRequest, plan: OutputPlan) -> list[list[int]]:
        with as_generation_errors():
            if isinstance(req, ChatCompletionRequest):
                return [chat_prompt_ids(self.state, req.messages, add_generation_prompt=True, tools=plan.tools,
                                        template_kwargs=req.chat_template_kwargs,
                                        reasoning_effort=req.reasoning_effort)]
            assert isinstance(req, CompletionRequest)
            if isinstance(req.prompt, str):
                return [self.tokenizer.encode(req.prompt)]
            check_token_ids(req.prompt, self.vocab_size, "prompt")
            return [list(req.prompt)]

    async def _start(self, prompt: Prompt, overrides: GenerationConfig | Mapping[str, Any] | None,
                     stream: bool) -> tuple[Generation, StructuredRequest, GenerationConfig]:
        """The call's Generation, submitted to the worker pool (by the HTTP API's own preparation:
        `OpenAIServing.prepare`), its request and the values the call asked for."""
        if self._closed:
            raise GenerationError("this generator is closed", 503, code="closed")
        arrival = time.perf_counter()
        config = self.config.merged(GenerationConfig.of(overrides))
        req = self._request(prompt, config, stream)

        async def prompt_ids(plan: OutputPlan) -> list[list[int]]:
            return await asyncio.to_thread(self._prompt_ids, req, plan)  # a chat template or a long text: off the loop

        with as_generation_errors():
            prepared = await self.serving.prepare(req, prompt_ids, rid=request_id("gen"), arrival=arrival,
                                                  logprobs=(True, 0))
        return prepared.gens[0], req, config

    async def _events(self, gen: Generation) -> AsyncIterator[Any]:
        """The generation's events to its end; leaving early cancels it (serving.events does)."""
        self._open.add(gen)
        try:
            async with aclosing(self.serving.events([gen])) as events:
                with as_generation_errors():
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


class GeneratorBuilder:
    """`Generator.builder(model)`: chain the set-up calls, then `await .build()` (or `.build_sync()`)."""

    def __init__(self, model: str) -> None:
        self._settings: dict[str, Any] = {"model": model}
        self._config: dict[str, Any] = {}
        self._quiet = False
        self._offline = False

    # ---- where it runs ----
    def device(self, device: str) -> GeneratorBuilder:
        """Any torch device: cpu, cuda, cuda:1, ..."""
        return self.setting("device", device)

    def cpu(self) -> GeneratorBuilder:
        return self.device("cpu")

    def gpu(self, index: int | None = None) -> GeneratorBuilder:
        """The (first, or `index`th) CUDA GPU."""
        return self.device("cuda" if index is None else f"cuda:{index}")

    def model_path(self, path: str | Path) -> GeneratorBuilder:
        """Load the weights from a .gguf file or a safetensors directory; the builder's name stays the model's
        name (`Generator.model_name`)."""
        self._settings.setdefault("served_model_name", self._settings["model"])
        return self.setting("model", str(path))

    def prefix_cache(self, enabled: bool = True) -> GeneratorBuilder:
        """Reuse the KV cache of prompt prefixes seen before (on by default)."""
        return self.setting("prefix_caching", enabled)

    def draft(self, name: str, num_tokens: int) -> GeneratorBuilder:
        """Speculative decoding with a draft model of the same vocabulary (a name, a path, or `self-int4` /
        `self-int8`: this model quantized) proposing up to `num_tokens` tokens a step."""
        return self.setting("draft_model", name).setting("num_speculative_tokens", num_tokens)

    def offline(self) -> GeneratorBuilder:
        """Never fetch anything (the default, unless `pull()`): `build()` refuses at once a model that is not
        installed, not pulled or not found."""
        self._offline = True
        return self

    def pull(self, enabled: bool = True) -> GeneratorBuilder:
        """Download the model (and a draft model) from the Hugging Face Hub first when it is a Hugging Face name
        (`owner/repo:QUANT`, `owner/repo`) not in the local cache, as `emberserve pull` does."""
        return self.setting("pull", enabled)

    def quiet(self) -> GeneratorBuilder:
        """No load progress bar on stderr."""
        self._quiet = True
        return self

    def setting(self, name: str, value: Any) -> GeneratorBuilder:
        """Any server setting by its Settings field name (`max_num_seqs`, `quant`, `kv_cache_memory`, ...; an old
        name, `max_running`, still works)."""
        name = RENAMED.get(name, name)
        if name not in Settings.model_fields:
            raise ValueError(f"unknown setting {name!r}; the settings are {', '.join(Settings.model_fields)}")
        self._settings[name] = value
        return self

    # ---- generation values ----
    def temperature(self, value: float) -> GeneratorBuilder:
        return self._value("temperature", value)

    def top_p(self, value: float) -> GeneratorBuilder:
        return self._value("top_p", value)

    def top_k(self, value: int) -> GeneratorBuilder:
        return self._value("top_k", value)

    def min_p(self, value: float) -> GeneratorBuilder:
        return self._value("min_p", value)

    def repetition_penalty(self, value: float) -> GeneratorBuilder:
        return self._value("repetition_penalty", value)

    def max_tokens(self, value: int) -> GeneratorBuilder:
        return self._value("max_tokens", value)

    def seed(self, value: int) -> GeneratorBuilder:
        return self._value("seed", value)

    def greedy(self) -> GeneratorBuilder:
        """Always the most likely token (temperature 0)."""
        return self.temperature(0.0)

    def preset(self, name: str) -> GeneratorBuilder:
        """Start every call from a preset's values (server/config/presets.py; a call may name another)."""
        return self.setting("preset", get_preset(name).name)

    def creative(self) -> GeneratorBuilder:
        return self.preset("creative")

    def precise(self) -> GeneratorBuilder:
        return self.preset("precise")

    def _value(self, name: str, value: Any) -> GeneratorBuilder:
        self._config[name] = value
        return self

    # ---- building ----
    def settings(self) -> Settings:
        """The server settings collected so far, validated (ValueError naming the setting otherwise)."""
        try:
            return Settings(**self._settings)
        except ValidationError as e:
            err = e.errors()[0]
            name = str(err["loc"][0]) if err["loc"] else "settings"
            raise ValueError(f"{name} ({flag_name(name)} / {env_name(name)}): {err['msg']}") from None

    async def build(self) -> Generator:
        """Load the model (on a thread of its own, as the server does) and start its worker."""
        settings = self.settings()
        config = GenerationConfig.of(self._config)
        generation_request(settings.model, "", config)  # the values are a valid request, or this raises now
        if settings.model in KNOWN_MODELS and not is_generator_model(settings.model):
            raise ValueError(f"{settings.model} is an encoder: it embeds, it does not generate")
        if self._offline and settings.pull:
            raise ValueError("offline() and pull() contradict each other: pulling fetches the model")
        if self._offline:
            # refuse what would need fetching: ModelNotInstalledError (with the install command), ModelFormatError
            model_path(settings.model)
        if settings.pull:  # download on a thread: the event loop runs on while the files come
            for name in (settings.model, settings.draft_model):
                if name is not None and name not in SELF_DRAFTS:
                    await asyncio.to_thread(ensure_model, name, True)
        progress = no_progress if self._quiet else None
        state = await in_own_thread(lambda: load_model(settings, progress=progress, prepare_grammars=False),
                                     stop_workers)
        return Generator(state, config)

    def build_sync(self) -> SyncGenerator:
        """A `SyncGenerator`: the same generator for scripts, run on an event loop thread of its own."""
        return SyncGenerator(self.build())


class SyncGenerator:
    """`Generator.builder(...).build_sync()`; `close()` it, or use it in a `with` block."""

    def __init__(self, build: Coroutine[Any, Any, Generator]) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="emberserve-generator-loop", daemon=True)
        self._thread.start()
        try:
            self.generator: Generator = self._wait(build)
        except BaseException:
            self._stop_loop()
            raise

    def _wait(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # ---- what is served ----
    @property
    def model_name(self) -> str:
        return self.generator.model_name

    @property
    def device(self) -> str:
        return self.generator.device

    @property
    def context_size(self) -> int:
        return self.generator.context_size

    @property
    def vocab_size(self) -> int:
        return self.generator.vocab_size

    @property
    def generation_config(self) -> GenerationConfig:
        return self.generator.generation_config

    # ---- generating ----
    def generate(self, prompt: Prompt) -> GeneratedText:
        """The text (a `str` carrying the tokens, logprobs, finish reason and config), as `Generator.generate`."""
        return self._wait(self.generator.generate(prompt))

    def generate_with_config(self, prompt: Prompt, overrides: Overrides) -> GeneratedText:
        return self._wait(self.generator.generate_with_config(prompt, overrides))

    def generate_batch(self, prompts: Sequence[Prompt], overrides: Overrides = None) -> list[GeneratedText]:
        """Every prompt at once (batched by the worker), the results in the prompts' order."""
        async def every() -> list[GeneratedText]:
            return list(await asyncio.gather(*(self.generator.generate_with_config(p, overrides) for p in prompts)))

        return self._wait(every())

    def stream(self, prompt: Prompt, overrides: Overrides = None) -> Iterator[StreamedToken]:
        """The tokens as they come; leaving the loop early (or closing the iterator) cancels the generation."""
        items: queue.SimpleQueue[Any] = queue.SimpleQueue()

        async def pump() -> None:
            try:
                async with aclosing(self.generator.stream(prompt, overrides)) as tokens:
                    async for token in tokens:
                        items.put(token)
            except BaseException as e:  # handed to the reading thread (a cancellation included)
                items.put(e)
            finally:
                items.put(_END)

        future = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := items.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()  # no-op when it is done; else the stream is closed and its generation cancelled

    def stream_text(self, prompt: Prompt, overrides: Overrides = None) -> Iterator[str]:
        for token in self.stream(prompt, overrides):
            if token.text:
                yield token.text

    # ---- closing ----
    def close(self) -> None:
        """Close the generator (its worker threads) and end the loop thread."""
        if self._loop.is_closed():
            return
        try:
            self._wait(self.generator.close())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> SyncGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
