"""POST /v1/completions: prompts (text or token ids) → Generations → a text_completion or its SSE chunks."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from server.errors import APIError, invalid
from server.scheduling.generation import ChoiceDelta, Generation, GenerationDone, PromptLogprobs, PositionLogprobs
from server.api.openai.preparation import OutputPlan
from server.api.openai.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from server.api.openai.serving import OpenAIServing, cancel, check_token_ids, prompt_work, reported_logprob, request_id
from server.api.sse import DONE, event_json, sse_response


@dataclass
class _Prompt:
    ids: list[int]
    text: str


@dataclass
class _LogprobsBuilder:
    """Accumulates the completions-shaped logprobs of one choice, with character offsets into its text."""

    serving: OpenAIServing
    offset: int = 0
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, entry: PositionLogprobs | None, token: int) -> None:
        text = self.serving.token_text(token)
        self.tokens.append(text)
        self.text_offset.append(self.offset)
        self.offset += len(text)
        self.token_logprobs.append(None if entry is None else reported_logprob(entry.logprob))
        self.top_logprobs.append(None if entry is None else {self.serving.token_text(t): reported_logprob(lp)
                                                             for t, lp in entry.top})

    def take(self) -> CompletionLogprobs:
        """What was added since the last take (streaming sends each chunk's own tokens)."""
        out = CompletionLogprobs(tokens=self.tokens, token_logprobs=self.token_logprobs,
                                 top_logprobs=self.top_logprobs, text_offset=self.text_offset)
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out


class CompletionServing(OpenAIServing):
    """Legacy text completions, one Generation per prompt, `n` choices each."""

    async def create(self, req: CompletionRequest, request: Request) -> CompletionResponse | Any:
        arrival = time.perf_counter()
        self.check_model(req.model)
        self.log_unknown_fields(req)
        if req.suffix:
            raise invalid("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise invalid("best_of is not supported (only best_of == n)", param="best_of")
        prompts: list[_Prompt] = []

        async def prompt_ids(_: OutputPlan) -> list[list[int]]:
            prompts.extend(await prompt_work(self._prompts, req))
            return [p.ids for p in prompts]

        gens = (await self.prepare(req, prompt_ids, rid=request_id("cmpl"), arrival=arrival)).gens
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return sse_response(self._stream(gens, prompts, req, include_usage), on_close=lambda: cancel(gens),
                                send_timeout=self.state.stream_timeout)
        return await self._complete(gens, prompts, req, request)

    def _prompts(self, req: CompletionRequest) -> list[_Prompt]:
        raw = req.prompt
        if isinstance(raw, str):
            raw = [raw]
        if not raw:
            raise invalid("prompt must not be empty", param="prompt")
        if isinstance(raw[0], int):
            raw = [raw]
        # Checked before tokenizing: more prompts than a worker may queue could only end in a 429 that no retry cures.
        limit = max(1, self.state.pool.max_queued)
        if len(raw) > limit:
            raise invalid(f"prompt is a list of {len(raw)} prompts; this server takes at most {limit} per request "
                          "(its --max-queued)", param="prompt", code="too_many_prompts")
        prompts = []
        for item in raw:
            if isinstance(item, str):
                prompts.append(_Prompt(self.tokenizer.encode(item), item))
                continue
            check_token_ids(item, self.model.vocab_size, "prompt")
            prompts.append(_Prompt(list(item), self.tokenizer.decode(item) if req.echo else ""))  # text: for echo
        return prompts

    def _choice_start(self, prompt: _Prompt, echo: bool, builder: _LogprobsBuilder | None,
                      prompt_lp: list[PositionLogprobs | None] | None) -> str:
        """The echoed prompt text (and its logprobs into `builder`) that opens each choice."""
        if not echo:
            return ""
        if builder is not None:
            for token, entry in zip(prompt.ids, prompt_lp or [None] * len(prompt.ids)):
                builder.add(entry, token)
        return prompt.text

    async def _complete(self, gens: list[Generation], prompts: list[_Prompt], req: CompletionRequest,
                        request: Request) -> CompletionResponse:
        n = req.n  # choice index = prompt index * n + the prompt's own choice index
        # Echo without logprobs needs no prompt pass: the prompt text opens each choice directly.
        texts = [self._choice_start(p, req.echo and gen.prompt_logprobs is None, None, None)
                 for gen, p in zip(gens, prompts) for _ in range(n)]
        finish: list[str | None] = [None] * len(texts)
        builders = [_LogprobsBuilder(self) for _ in texts] if req.logprobs is not None else None
        prompt_tokens = completion_tokens = cached_tokens = done = 0
        async with aclosing(self.events(gens, request)) as events:
            async for gen, event in events:
                base = gen.prompt_index * n
                if isinstance(event, PromptLogprobs):
                    for i in range(base, base + n):
                        texts[i] = self._choice_start(prompts[gen.prompt_index], True,
                                                      builders[i] if builders else None, event.entries)
                elif isinstance(event, ChoiceDelta):
                    i = base + event.index
                    texts[i] += event.text
                    if builders:
                        for entry in event.logprobs or []:
                            builders[i].add(entry, entry.token)
                    finish[i] = event.finish_reason or finish[i]
                elif isinstance(event, GenerationDone):
                    prompt_tokens += event.prompt_tokens
                    completion_tokens += event.completion_tokens
                    cached_tokens += event.cached_tokens
                    done += 1
        if done < len(gens):  # the client went away; nobody reads this
            raise APIError(499, "client closed request")
        choices = [CompletionChoice(index=i, text=texts[i], finish_reason=finish[i],
                                    logprobs=builders[i].take() if builders else None) for i in range(len(texts))]
        return CompletionResponse(id=gens[0].request_id, model=req.model, choices=choices,
                                  usage=self.usage(prompt_tokens, completion_tokens, cached_tokens),
                                  system_fingerprint=self.state.fingerprint)

    async def _stream(self, gens: list[Generation], prompts: list[_Prompt], req: CompletionRequest,
                      include_usage: bool) -> AsyncIterator[str | list[str]]:
        """Every prompt's choices interleaved as their tokens come, each chunk carrying one choice."""
        created = int(time.time())
        n = req.n

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
            body: dict[str, Any] = {"id": gens[0].request_id, "object": "text_completion", "created": created,
                                    "model": req.model, "system_fingerprint": self.state.fingerprint,
                                    "choices": choices}
            if include_usage:
                body["usage"] = usage
            return event_json(body)

        def choice(index: int, text: str, builder: _LogprobsBuilder | None, finish: str | None = None) -> dict:
            lp = builder.take().model_dump() if builder is not None else None
            return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}

        total = len(gens) * n
        builders = [_LogprobsBuilder(self) for _ in range(total)] if req.logprobs is not None else None
        started = [False] * total
        # What arrived for each choice since the last chunks went out. Everything already waiting is read before
        # anything is sent, so a reader that falls behind sends one chunk per choice for several tokens.
        texts, finish = [""] * total, [None] * total
        dirty: dict[int, None] = {}  # choices with something to send, in the order it came
        channel = gens[0].channel
        prompt_tokens = completion_tokens = cached_tokens = 0

        def flush() -> list[str]:
            out = []
            for i in dirty:
                b = builders[i] if builders else None
                if texts[i] or (b is not None and b.tokens):
                    out.append(chunk([choice(i, texts[i], b)]))
                    texts[i] = ""
                if finish[i] is not None:
                    out.append(chunk([choice(i, "", None, finish[i])]))
                    finish[i] = None
            dirty.clear()
            return out

        try:
            async with aclosing(self.events(gens)) as events:
                async for gen, event in events:
                    base, prompt = gen.prompt_index * n, prompts[gen.prompt_index]
                    if isinstance(event, PromptLogprobs):
                        for i in range(base, base + n):
                            b = builders[i] if builders else None
                            texts[i] += self._choice_start(prompt, True, b, event.entries)
                            started[i] = True
                            dirty[i] = None
                    elif isinstance(event, ChoiceDelta):
                        i = base + event.index
                        if not started[i]:
                            texts[i], started[i] = texts[i] + self._choice_start(prompt, req.echo, None, None), True
                        texts[i] += event.text
                        if builders:
                            for entry in event.logprobs or []:
                                builders[i].add(entry, entry.token)
                        finish[i] = event.finish_reason
                        dirty[i] = None
                    elif isinstance(event, GenerationDone):
                        prompt_tokens += event.prompt_tokens
                        completion_tokens += event.completion_tokens
                        cached_tokens += event.cached_tokens
                    if channel.empty():
                        lines = flush()
                        if lines:
                            yield lines  # every choice's news in one write
            if include_usage:
                yield chunk([], self.usage(prompt_tokens, completion_tokens, cached_tokens).model_dump())
        except APIError as e:
            yield self.stream_error(e)
        yield DONE
