"""Endpoints whose requests are chat completions in another dress (OpenAI's Responses, Anthropic's Messages).

Each maps its request onto a `ChatCompletionRequest` and from there takes the chat path's own steps: the one
preparation of every generating endpoint (`OpenAIServing.prepare`: the output's grammar and tool plan by
`plan_output`, the prompt ids from the chat template by `chat_prompt_ids`, the sampling values and their defaults,
the budget by the chat's rules and the context check, the Generation, the worker queue), and the events as they
come (`events`); structured formats and tool calls are the chat endpoint's, parsed into the endpoint's blocks by
`server.api.output_blocks`. Only the shape of the answer is
the endpoint's. An error those steps raise names the chat field; it is renamed to the endpoint's own field
(`max_tokens` becomes `max_output_tokens`, `tools.0.function.parameters` becomes `tools.0.input_schema`, say).
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from server.api.errors import error_param
from server.errors import APIError, internal_error, invalid
from server.scheduling.generation import ChoiceDelta, Generation, GenerationDone
from server.api.openai.protocol import ChatCompletionRequest
from server.api.openai.serving import OpenAIServing, prompt_work
from server.api.openai.preparation import OutputPlan, chat_prompt_ids, plan_output
from server.api.sse import event_json
from server.api.openai.tool_calls import ToolPlan

log = logging.getLogger("emberserve.serving")


@dataclass
class ChatOutcome:
    """What one generated choice came to: its answer and thinking, why it ended and the token counts."""

    text: str = ""                        # the answer (a reasoning model's output past its thinking)
    reasoning: str = ""                   # a reasoning model's thinking
    finish_reason: str | None = None      # "stop" or "length", as on the chat path
    stop_reason: str | int | None = None  # with "stop": the stop string, or the end token's id
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0             # the completion tokens spent thinking
    done: bool = False

    def add(self, event: object) -> Piece:
        """Take one event of the generation; the new thinking and answer text it brings."""
        if isinstance(event, ChoiceDelta):
            self.text += event.text
            self.reasoning += event.reasoning
            if event.finish_reason is not None:
                self.finish_reason, self.stop_reason = event.finish_reason, event.stop_reason
            return Piece(event.reasoning, event.text)
        if isinstance(event, GenerationDone):
            self.prompt_tokens, self.completion_tokens = event.prompt_tokens, event.completion_tokens
            self.cached_tokens, self.reasoning_tokens = event.cached_tokens, event.reasoning_tokens
            self.done = True
        return Piece()


@dataclass
class Piece:
    """New output of a choice: thinking, then answer (the thinking always ends before the answer begins)."""

    reasoning: str = ""
    text: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.text)


def renamed_param(param: str | None, names: dict[str, str]) -> str | None:
    """A chat field (or a path into it) as the endpoint names it. `names` maps chat paths to the endpoint's, "*"
    standing for any one segment ("tools.*.function": "tools.*" makes tools.0.function.name tools.0.name); the
    longest path that matches renames."""
    if param is None:
        return None
    parts = param.split(".")
    for chat, own in sorted(names.items(), key=lambda kv: -kv[0].count(".")):
        pattern = chat.split(".")
        if len(pattern) > len(parts) or any(p not in ("*", q) for p, q in zip(pattern, parts)):
            continue
        stars = iter(q for p, q in zip(pattern, parts) if p == "*")
        head = [next(stars) if p == "*" else p for p in own.split(".")]
        return ".".join(head + parts[len(pattern):])
    return param


def renamed(error: APIError, names: dict[str, str]) -> APIError:
    """`error` with its param named as the endpoint names the field."""
    param = renamed_param(error.param, names)
    if param == error.param:
        return error
    return APIError(error.status, error.message, param=param, code=error.code, type=error.type,
                    headers=error.headers)


class ChatMappedServing(OpenAIServing):
    """The chat path for a request that maps onto a chat completion; subclasses say how to map and answer."""

    # The chat request's fields as this endpoint calls them, for the errors the chat path raises.
    field_names: dict[str, str] = {}

    async def coalesced(self, gen: Generation, outcome: ChatOutcome) -> AsyncIterator[Piece]:
        """The generation's new output for a stream, `outcome` taking every event: everything already waiting is
        read before a piece is given, so a reader that falls behind gets one piece for several tokens."""
        pending = Piece()
        async with aclosing(self.events([gen])) as events:
            async for _, event in events:
                new = outcome.add(event)
                pending.reasoning += new.reasoning
                pending.text += new.text
                if pending and gen.channel.empty():
                    yield pending
                    pending = Piece()
        if pending:
            yield pending

    @contextmanager
    def own_field_names(self) -> Iterator[None]:
        try:
            yield
        except APIError as e:
            raise renamed(e, self.field_names) from None

    def chat_request(self, fields: dict[str, Any]) -> ChatCompletionRequest:
        """`fields` validated as a chat request: the chat rules hold (stop strings, ranges), named as ours."""
        try:
            return ChatCompletionRequest.model_validate(fields)
        except ValidationError as e:
            errors = e.errors()
            param = renamed_param(error_param(errors), self.field_names)
            where = renamed_param(error_param(errors[:1]), self.field_names)
            message = str(errors[0].get("msg", "invalid value")).removeprefix("Value error, ")
            raise invalid(f"{where}: {message}" if where else message, param=param) from None

    def output_plan(self, chat: ChatCompletionRequest) -> OutputPlan:
        """The chat's grammar and tool plan, as the chat endpoint makes them."""
        with self.own_field_names():
            return plan_output(chat, self.tokenizer.chat_template)

    async def prompt_ids(self, chat: ChatCompletionRequest, tools: ToolPlan | None) -> list[int]:
        """The chat's prompt ids (the chat template with the tools, off the event loop)."""
        with self.own_field_names():
            return await prompt_work(chat_prompt_ids, self.state, chat.messages, chat.add_generation_prompt,
                                     tools, chat.chat_template_kwargs, chat.reasoning_effort)

    async def start(self, chat: ChatCompletionRequest, rid: str, arrival: float) -> tuple[Generation, ToolPlan | None]:
        """The chat's Generation, queued for a worker (429 when the queue is full), and the tool plan its output
        is parsed with (None: text only)."""
        async def prompt(plan: OutputPlan) -> list[list[int]]:
            return [await self.prompt_ids(chat, plan.tools)]

        with self.own_field_names():
            prepared = await self.prepare(chat, prompt, rid=rid, arrival=arrival)
        return prepared.gens[0], prepared.plan.calls

    async def collect(self, gen: Generation, request: Request) -> ChatOutcome:
        """Run `gen` to its end (cancelled if the client goes away first: then a 499 nobody reads)."""
        outcome = ChatOutcome()
        async with aclosing(self.events([gen], request)) as events:
            async for _, event in events:
                outcome.add(event)
        if not outcome.done:
            raise APIError(499, "client closed request")
        return outcome

    async def guarded(self, events: AsyncIterator[Any],
                      failure: Callable[[APIError], list[Any]]) -> AsyncIterator[Any]:
        """A stream's events, ended by this endpoint's own error events if anything fails after it started
        (counted in the metrics, since the error handlers never see it; the traceback only in the log)."""
        async with aclosing(events):
            try:
                async for event in events:
                    yield event
            except APIError as e:
                error = e
            except Exception:
                log.exception("unhandled error while streaming")
                error = internal_error()
            else:
                return
        self.metrics.fail(error.type)
        for event in failure(error):
            yield event


def named_event(kind: str, body: dict[str, Any]) -> dict[str, str]:
    """One server-sent event with an `event:` name, as the Responses and Anthropic streams send them."""
    return {"event": kind, "data": event_json(body)}
