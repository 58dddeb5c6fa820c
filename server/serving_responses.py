"""POST /v1/responses (OpenAI's Responses API) on the chat path, and the stored responses' routes.

A request maps onto a chat completion (`chat_fields`): `instructions` as the system message, the turns of the
response named by `previous_response_id`, then `input`. With `store` (the default) the response is kept in a
`ResponseStore` with its conversation so far, so that the next turn names it instead of resending it; its prompt
then begins with the tokens the last turn already computed, which the prefix cache serves.
"""
from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from .chat_mapping import ChatMappedServing, ChatOutcome, named_event
from .errors import APIError, invalid
from .generation import Generation
from .metrics import ServerMetrics
from .protocol_responses import (IncompleteDetails, InputItemList, InputMessage, InputMessageItem,
                                 InputTokensDetails, OutputMessage, OutputText, ResponseDeleted, ResponseObject,
                                 ResponsesRequest, ResponseUsage)
from .response_store import ResponseStore
from .serving import ModelState, cancel
from .sse import sse_response

Message = dict[str, str]  # one chat message: {"role", "content"}


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    input_items: list[InputMessageItem]  # this turn's own input, as GET .../input_items lists it
    conversation: list[Message]          # every turn up to this response's answer, without the instructions


@dataclass(frozen=True)
class _Turn:
    """One request's response as known before generating: what its response object echoes."""

    id: str
    message_id: str
    created_at: int
    req: ResponsesRequest
    history: list[Message]
    inputs: list[Message]
    temperature: float
    top_p: float


def refuse_unsupported(req: ResponsesRequest) -> None:
    """400 for what needs tool calling or structured outputs (issue 14's machinery, not wired in yet)."""
    if req.tools:
        raise invalid("tools are not supported yet", param="tools")
    if req.tool_choice not in (None, "auto", "none"):
        raise invalid("tool_choice other than 'auto' or 'none' needs tools, which are not supported yet",
                      param="tool_choice")
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        raise invalid(f"text.format of type {fmt.type!r} is not supported yet: only 'text'", param="text.format")


def input_messages(items: str | list[InputMessage]) -> list[Message]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    return [{"role": item.role, "content": item.text()} for item in items]


def chat_fields(req: ResponsesRequest, history: list[Message], inputs: list[Message]) -> dict[str, Any]:
    """The chat completion request that a Responses request is."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    return {"model": req.model, "messages": system + history + inputs, "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "preset": req.preset, "stream": req.stream}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _input_items(items: str | list[InputMessage]) -> list[InputMessageItem]:
    """The request's input as stored items, each with an id of its own."""
    if isinstance(items, str):
        return [InputMessageItem(id=_new_id("msg"), role="user", content=[{"type": "input_text", "text": items}])]
    out = []
    for item in items:
        if isinstance(item.content, str):
            kind = "output_text" if item.role == "assistant" else "input_text"
            content = [{"type": kind, "text": item.content}]
        else:
            content = [{"type": part.type, "text": part.text} for part in item.content]
        out.append(InputMessageItem(id=_new_id("msg"), role=item.role, content=content))
    return out


class ResponsesServing(ChatMappedServing):
    """POST /v1/responses, and GET / DELETE of the responses it stored."""

    field_names = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                   "max_tokens": "max_output_tokens"}

    def __init__(self, state: ModelState, metrics: ServerMetrics, store: ResponseStore[StoredResponse]) -> None:
        super().__init__(state, metrics)
        self.store = store

    async def create(self, req: ResponsesRequest, request: Request) -> ResponseObject | Any:
        arrival = time.perf_counter()
        self.check_model(req.model)
        self.log_unknown_fields(req)
        refuse_unsupported(req)
        history = self._history(req.previous_response_id)
        inputs = input_messages(req.input)
        chat = self.chat_request(chat_fields(req, history, inputs))
        rid = _new_id("resp")
        gen = await self.start(chat, rid, arrival)
        turn = _Turn(rid, _new_id("msg"), int(time.time()), req, history, inputs, gen.params.temperature,
                     gen.params.top_p)
        if req.stream:
            numbers = itertools.count()
            return sse_response(self.guarded(self._stream(gen, turn, numbers), self._failure(numbers)),
                                on_close=lambda: cancel([gen]), send_timeout=self.state.stream_timeout)
        return self._finish(turn, await self.collect(gen, request))

    def _history(self, previous_id: str | None) -> list[Message]:
        if previous_id is None:
            return []
        stored = self.store.get(previous_id)
        if stored is None:
            raise APIError(404, f"Previous response with id '{previous_id}' not found.",
                           param="previous_response_id", code="previous_response_not_found")
        return stored.conversation

    def _response(self, turn: _Turn, status: str, output: list[OutputMessage],
                  usage: ResponseUsage | None) -> ResponseObject:
        req = turn.req
        return ResponseObject(
            id=turn.id, created_at=turn.created_at, status=status, model=req.model, output=output,
            output_text="".join(part.text for item in output for part in item.content),
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            previous_response_id=req.previous_response_id, store=req.store, temperature=turn.temperature,
            top_p=turn.top_p, tool_choice=req.tool_choice if isinstance(req.tool_choice, str) else "auto",
            usage=usage, metadata=req.metadata or {}, user=req.user)

    def _finish(self, turn: _Turn, outcome: ChatOutcome) -> ResponseObject:
        """The finished response, stored when the request asked for it."""
        status = "incomplete" if outcome.finish_reason == "length" else "completed"
        message = OutputMessage(id=turn.message_id, status=status, content=[OutputText(text=outcome.text)])
        usage = ResponseUsage(input_tokens=outcome.prompt_tokens,
                              input_tokens_details=InputTokensDetails(cached_tokens=outcome.cached_tokens,
                                                                      cache_write_tokens=self._written(outcome)),
                              output_tokens=outcome.completion_tokens,
                              total_tokens=outcome.prompt_tokens + outcome.completion_tokens)
        response = self._response(turn, status, [message], usage)
        if turn.req.store:
            answer = {"role": "assistant", "content": outcome.text}
            self.store.put(turn.id, StoredResponse(response, _input_items(turn.req.input),
                                                   [*turn.history, *turn.inputs, answer]))
        return response

    def _written(self, outcome: ChatOutcome) -> int:
        """The prompt's whole blocks past those read from the prefix cache: computed here, and kept there."""
        blocks = self.runner.blocks
        if not blocks.prefix_caching:
            return 0
        return max(0, outcome.prompt_tokens // blocks.block_size * blocks.block_size - outcome.cached_tokens)

    async def _stream(self, gen: Generation, turn: _Turn, numbers: itertools.count) -> AsyncIterator[dict[str, str]]:
        """The published event order: created, in_progress, the output item and its text part opened, text
        deltas, then each closed again in turn, and completed (or incomplete, when cut by max_output_tokens)."""

        def event(kind: str, **fields: Any) -> dict[str, str]:
            return named_event(kind, {"type": kind, "sequence_number": next(numbers), **fields})

        started = self._response(turn, "in_progress", [], None).model_dump()
        yield event("response.created", response=started)
        yield event("response.in_progress", response=started)
        opened = OutputMessage(id=turn.message_id, status="in_progress", content=[])
        yield event("response.output_item.added", output_index=0, item=opened.model_dump())
        where = {"item_id": turn.message_id, "output_index": 0, "content_index": 0}
        yield event("response.content_part.added", **where, part=OutputText(text="").model_dump())
        outcome, pending = ChatOutcome(), ""
        # Everything already waiting is read before anything is sent: a reader that falls behind gets one delta
        # for several tokens.
        async with aclosing(self.events([gen])) as events:
            async for _, item in events:
                pending += outcome.add(item)
                if pending and gen.channel.empty():
                    yield event("response.output_text.delta", **where, delta=pending, logprobs=[])
                    pending = ""
        if pending:
            yield event("response.output_text.delta", **where, delta=pending, logprobs=[])
        response = self._finish(turn, outcome)
        message = response.output[0]
        yield event("response.output_text.done", **where, text=outcome.text, logprobs=[])
        yield event("response.content_part.done", **where, part=message.content[0].model_dump())
        yield event("response.output_item.done", output_index=0, item=message.model_dump())
        kind = "response.completed" if response.status == "completed" else "response.incomplete"
        yield event(kind, response=response.model_dump())

    @staticmethod
    def _failure(numbers: itertools.count) -> Callable[[APIError], list[dict[str, str]]]:
        """A failure after the stream started: the published `error` event, numbered in the stream's sequence."""
        return lambda e: [named_event("error", {"type": "error", "sequence_number": next(numbers), "code": e.code,
                                                "message": e.message, "param": e.param})]

    # ---- stored responses ----

    def _stored(self, response_id: str) -> StoredResponse:
        stored = self.store.get(response_id)
        if stored is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id",
                           code="response_not_found")
        return stored

    def retrieve(self, response_id: str) -> ResponseObject:
        return self._stored(response_id).response

    def delete(self, response_id: str) -> ResponseDeleted:
        self._stored(response_id)
        self.store.delete(response_id)
        return ResponseDeleted(id=response_id)

    def input_items(self, response_id: str, limit: int, order: str, after: str | None) -> InputItemList:
        items = self._stored(response_id).input_items
        if order == "desc":
            items = items[::-1]
        if after is not None:
            ids = [item.id for item in items]
            if after not in ids:
                raise invalid(f"no input item with id '{after}' in response '{response_id}'", param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return InputItemList(data=page, first_id=page[0].id if page else None, last_id=page[-1].id if page else None,
                             has_more=len(items) > limit)
