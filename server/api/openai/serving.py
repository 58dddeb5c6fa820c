"""What the generating endpoints share: model check, request → Generation (`OpenAIServing.prepare`), running it,
logprob and usage shapes."""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any, Callable, TypeVar

from fastapi import Request
from starlette.concurrency import run_in_threadpool


from engine.errors import CONTEXT_LENGTH_EXCEEDED

from server.errors import APIError, invalid
from server.scheduling.generation import Event, Generation, GenerationDone, GenerationFailed
from server.grammar.compiler import CompiledGrammar, GrammarCompiler, GrammarSpec, StructuredOutputError
from server.api.metrics import ServerMetrics
from server.config.presets import PRESETS, layered_defaults
from server.api.openai.preparation import (OutputPlan, Prepared, PromptIds, budget_fields, plan_output,
                                          prompt_logprobs, requested_logprobs)
from server.api.openai.protocol import ChatCompletionRequest, OpenAIRequest, StructuredRequest, TopLogprob, Usage
from server.logs import current_request
from server.reasoning.plan import EFFORT_BUDGETS, ReasoningPlan, make_plan
from server.sampling.params import SamplingParams, out_of_vocabulary
from server.scheduling.model_state import ModelState
from server.api.sse import sse_error

log = logging.getLogger("emberserve.serving")
DISCONNECT_POLL_S = 0.2
# Events a stream's reader may be behind, per choice, before the worker pauses its generation: a client that stops
# reading holds its blocks but costs no more compute, until the stream's send timeout cuts it.
STREAM_BACKLOG_PER_CHOICE = 256
# A request's prompt work (its chat template, tokenizing) runs on the event loop when its body is at most this big:
# for a small prompt the hop to a worker thread and back costs more than the work, and its GIL hand-offs slow
# every stream the loop serves (bench/http_cost.py; bench/RESULTS.md#issue-13-http-cost-host-side). A bigger body
# goes to the thread pool, so that the loop serves the other requests meanwhile (the tokenizer runs there without
# the GIL).
INLINE_PROMPT_BYTES = 16384
T = TypeVar("T")


async def prompt_work(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args), a request's prompt work: on the event loop for a small request body, else in the thread pool."""
    record = current_request()
    if record is not None and record.body_bytes is not None and record.body_bytes <= INLINE_PROMPT_BYTES:
        return fn(*args)
    return await run_in_threadpool(fn, *args)


def check_model(state: ModelState, name: str) -> None:
    """404 unless `name` is the served model's id."""
    if name != state.model_id:
        raise APIError(404, f"The model `{name}` does not exist; this server serves `{state.model_id}`.",
                       param="model", code="model_not_found")


def check_token_ids(ids: Iterable[int], vocab_size: int, param: str) -> None:
    """400 naming the first few ids outside [0, vocab_size) (the sampler's rule, `out_of_vocabulary`)."""
    bad = out_of_vocabulary(ids, vocab_size)
    if bad:
        raise invalid(f"{param} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}", param=param)


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


MIN_LOGPROB = -9999.0  # what OpenAI and vLLM report for an impossible token: JSON has no -Infinity


def reported_logprob(value: float) -> float:
    """A logprob as the API reports it: finite, at least MIN_LOGPROB (NaN, from broken logits, too)."""
    return value if value >= MIN_LOGPROB else MIN_LOGPROB


def cancel(gens: Iterable[Generation]) -> None:
    """Ask the worker to drop these generations (idempotent)."""
    for gen in gens:
        gen.cancel()


class OpenAIServing:
    """Shared request handling for the chat and completions endpoints."""

    def __init__(self, state: ModelState, metrics: ServerMetrics) -> None:
        self.state, self.metrics = state, metrics
        self.model = state.model
        self.tokenizer = state.model.tokenizer

    def check_model(self, name: str) -> None:
        """404 unless `name` is the served model; the request log names it either way."""
        record = current_request()
        if record is not None:
            record.model = name
        check_model(self.state, name)
        if self.model.is_encoder:
            raise invalid(f"this model serves embeddings only: `{name}` is an encoder; use POST /v1/embeddings",
                          param="model", code="embeddings_only")

    def log_unknown_fields(self, req: OpenAIRequest) -> None:
        if req.model_extra:
            log.info("ignoring unknown request fields: %s", ", ".join(sorted(req.model_extra)))

    def defaults(self, req: OpenAIRequest) -> dict[str, Any]:
        """Values for the fields `req` leaves out: the model's generation defaults, under the server's preset,
        under the request's (server/config/presets.py)."""
        return layered_defaults(self.model.generation_defaults, self.state.preset,
                                PRESETS[req.preset] if req.preset is not None else None)

    def sampling_params(self, req: OpenAIRequest, logprobs: bool, top_logprobs: int) -> SamplingParams:
        """The request's sampling values; for those it leaves out, its preset's, the server's or the model's."""
        defaults = self.defaults(req)

        def pick(name: str, fallback: float | int) -> float | int:
            value = getattr(req, name)
            return value if value is not None else defaults.get(name, fallback)

        try:
            return SamplingParams(
                temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", 0),
                min_p=pick("min_p", 0.0), presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty, repetition_penalty=pick("repetition_penalty", 1.0),
                logit_bias=self.logit_bias(req), seed=req.seed, logprobs=logprobs, top_logprobs=top_logprobs)
        except ValueError as e:
            raise invalid(str(e)) from None

    def completion_budget(self, req: OpenAIRequest, prompt_len: int, *fields: str) -> int:
        """The completion budget of a prompt: the first of `fields` the request sets, else its preset's (or the
        server's preset's) max_tokens, else the server's --max-tokens-default, clipped to the context, else the
        first field's own default (None: the rest of the context); checked against the context as `max_tokens`
        checks it."""
        for name in fields:
            if name in req.model_fields_set and getattr(req, name) is not None:
                return self.max_tokens(prompt_len, getattr(req, name))
        default_budget = self.defaults(req).get("max_tokens") or self.state.max_tokens_default
        if default_budget is not None:
            return min(default_budget, self.max_tokens(prompt_len, None))
        return self.max_tokens(prompt_len, getattr(req, fields[0]))

    def logit_bias(self, req: OpenAIRequest) -> dict[int, float]:
        bias = {int(k): float(v) for k, v in (req.logit_bias or {}).items()}
        check_token_ids(bias, self.model.vocab_size, "logit_bias")
        return bias

    async def compile_grammar(self, spec: GrammarSpec | None) -> CompiledGrammar | None:
        """The compiled grammar of a request's output constraint (off the event loop); 400 naming the field when
        it cannot be used."""
        if spec is None:
            return None
        if self.state.grammars is None:
            self.state.grammars = GrammarCompiler(self.tokenizer)
        try:
            return await run_in_threadpool(self.state.grammars.compile, spec)
        except StructuredOutputError as e:
            raise invalid(e.message, param=e.param) from None

    def max_tokens(self, prompt_len: int, requested: int | None) -> int:
        """The completion budget, checked against the context: 400 with the numbers when it does not fit."""
        context = self.model.context_size
        if requested is None:
            if prompt_len >= context:
                raise invalid(f"This model's maximum context length is {context} tokens, but the prompt has "
                              f"{prompt_len} tokens. Please reduce the length of the prompt.",
                              param="messages", code=CONTEXT_LENGTH_EXCEEDED)
            return context - prompt_len
        if prompt_len + requested > context:
            raise invalid(f"This model's maximum context length is {context} tokens. However, you requested "
                          f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
                          f"completion). Please reduce the prompt or max_tokens.",
                          param="max_tokens", code=CONTEXT_LENGTH_EXCEEDED)
        return requested

    def new_generation(self, req: OpenAIRequest, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
                       rid: str, arrival: float, prompt_logprobs: int | None = None, *, index: int = 0,
                       channel: asyncio.Queue[Any] | None = None,
                       grammar: CompiledGrammar | None = None, output: OutputPlan | None = None) -> Generation:
        """The Generation for one prompt of `req` held to `output`; the prompts of one request share `channel` (see
        `events`)."""
        param = "messages" if hasattr(req, "messages") else "prompt"
        if not prompt_ids:
            raise invalid("the prompt is empty: at least one token is needed", param=param)
        limit = self.state.max_prompt_tokens
        if limit is not None and len(prompt_ids) > limit:
            raise invalid(f"the prompt has {len(prompt_ids)} tokens; this server accepts at most {limit}",
                          param=param, code="prompt_too_long")
        if req.min_tokens > max_tokens:
            raise invalid(f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens})",
                          param="min_tokens")
        extra = {} if channel is None else {"channel": channel}
        return Generation(prompt_ids=prompt_ids, params=params, max_tokens=max_tokens, n=req.n, stop=req.stop,
                          stop_token_ids=self.tokenizer.end_token_ids, min_tokens=req.min_tokens,
                          ignore_eos=req.ignore_eos, prompt_logprobs=prompt_logprobs, request_id=rid,
                          prompt_index=index, arrival=arrival, grammar=grammar,
                          reasoning=self.reasoning_plan(req, prompt_ids, output),
                          max_backlog=STREAM_BACKLOG_PER_CHOICE * req.n if req.stream else None,
                          stream_interval=self.state.stream_interval, **extra)

    def reasoning_plan(self, req: OpenAIRequest, prompt_ids: list[int],
                       output: OutputPlan | None = None) -> ReasoningPlan | None:
        """How a chat's output thinks (None: a model without a reasoning format, or a completion, whose text is the
        caller's own): its tags, whether the prompt opened the thinking, its budget (`thinking_token_budget`, else
        `reasoning_effort`'s, which a harmony model's template takes instead); for harmony, whether the output's
        calls are parsed and whether a forced call's grammar holds all of it (`output`'s tool plan)."""
        fmt = self.state.reasoning
        if fmt is None or not isinstance(req, ChatCompletionRequest):
            return None
        budget = req.thinking_token_budget
        if budget is None and req.reasoning_effort is not None and fmt.kind != "harmony":
            budget = EFFORT_BUDGETS[req.reasoning_effort]
        tools = output.tools if output is not None else None
        return make_plan(fmt, prompt_ids, lambda text: self.tokenizer.encode(text, add_special_tokens=False),
                         self.tokenizer.decode, budget, calls=output is not None and output.calls is not None,
                         grammar_first=tools is not None and tools.format == "harmony" and tools.grammar is not None)

    async def prepare(self, req: StructuredRequest, prompts: PromptIds, *, rid: str, arrival: float,
                      logprobs: tuple[bool, int] | None = None) -> Prepared:
        """`req`, validated, as its Generations submitted to the worker pool: the one preparation of every endpoint
        that generates. In order: the output plan and its compiled grammar (`plan_output`); the prompt ids, by the
        endpoint's own step `prompts` given the plan; the sampling values (`logprobs`: (logprobs, top_logprobs),
        else as the request asks); for each prompt its budget (`budget_fields`) and its Generation, the prompts
        sharing one channel; then the submission (429 when the queue is full; all or none). A 400 names the field
        at fault."""
        plan = plan_output(req, self.tokenizer.chat_template)
        grammar = await self.compile_grammar(plan.grammar)
        ids = await prompts(plan)
        params = self.sampling_params(req, *(logprobs if logprobs is not None else requested_logprobs(req)))
        fields, echoed = budget_fields(req), prompt_logprobs(req)
        channel: asyncio.Queue[Any] = asyncio.Queue()  # every prompt's events, as they come
        gens = [self.new_generation(req, p, params, self.completion_budget(req, len(p), *fields), rid, arrival,
                                    prompt_logprobs=echoed, index=i, channel=channel, grammar=grammar, output=plan)
                for i, p in enumerate(ids)]
        self.submit(gens)
        return Prepared(gens, plan)

    def submit(self, gens: list[Generation]) -> None:
        """Queue the generations (429 when the queue is full); on failure none of them stays queued."""
        try:
            for gen in gens:
                self.state.pool.submit(gen)
        except APIError:
            cancel(gens)
            raise

    async def events(self, gens: list[Generation],
                     request: Request | None = None) -> AsyncIterator[tuple[Generation, Event]]:
        """Yield the events of a request's submitted generations as they come, until all are done.

        Leaving early (a disconnect, an error, the caller closing this iterator) cancels every one of them. With
        `request` given, a client that goes away is noticed while waiting, for non-streaming responses. Read it
        inside `contextlib.aclosing` so that the cancellation runs as soon as the caller stops.
        """
        loop = asyncio.get_running_loop()
        next_poll = loop.time() + DISCONNECT_POLL_S
        channel = gens[0].channel
        record = current_request()
        tracks = {gen: self.metrics.track(gen, record) for gen in gens}
        open_gens = set(gens)
        try:
            while open_gens:
                if request is None:
                    item = await channel.get()
                else:
                    # Poll on a clock, not only when idle: a busy generation sends events faster than the poll.
                    try:
                        item = await asyncio.wait_for(channel.get(), max(0.0, next_poll - loop.time()))
                    except TimeoutError:
                        item = None
                    if loop.time() >= next_poll:
                        next_poll = loop.time() + DISCONNECT_POLL_S
                        if await request.is_disconnected():
                            log.info("client went away: cancelling %s", gens[0].request_id)
                            return
                    if item is None:
                        continue
                gen, event = item
                tracks[gen].observe(event)
                if isinstance(event, GenerationFailed):
                    raise APIError(event.status, event.message, code=event.code,
                                   type="server_error" if event.status >= 500 else None)
                yield gen, event
                if isinstance(event, GenerationDone):
                    open_gens.discard(gen)
        finally:
            for track in tracks.values():
                track.close()
            cancel(gens)

    def stream_error(self, error: APIError) -> str:
        """A failure after the stream started, counted (the error handlers never see it) and as its SSE event."""
        self.metrics.fail(error.type)
        return sse_error(error)

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
              reasoning_tokens: int | None = None) -> Usage:
        """The token counts; `reasoning_tokens` (a reasoning model's chat) as OpenAI reports them."""
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details={"cached_tokens": cached_tokens},
                     completion_tokens_details=None if reasoning_tokens is None else
                     {"reasoning_tokens": reasoning_tokens})

    def done_usage(self, gen: Generation, done: GenerationDone) -> Usage:
        """A finished generation's usage, with its thinking tokens where it had a reasoning plan."""
        return self.usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens,
                          done.reasoning_tokens if gen.reasoning is not None else None)

    def token_text(self, token: int) -> str:
        """A token's text for logprobs; bytes that are not whole UTF-8 characters are shown escaped."""
        return self.tokenizer.token_bytes(token).decode("utf-8", errors="backslashreplace")

    def top_logprob(self, token: int, logprob: float) -> TopLogprob:
        return TopLogprob(token=self.token_text(token), logprob=reported_logprob(logprob),
                          bytes=list(self.tokenizer.token_bytes(token)))
