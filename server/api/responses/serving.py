"""POST /v1/responses (OpenAI's Responses API) on the chat path, and the stored responses' routes.

A request maps onto a chat completion (`server.api.responses.input`): `instructions` as the system message, the turns of
the response named by `previous_response_id`, then `input`; tools, tool_choice and text.format are chat's, so the output
is held to the same grammar and its calls parsed by the same parser. The output's blocks (`server.api.output_blocks`)
become output items: a reasoning model's thinking a reasoning item (one reasoning_text part, no summary), a message with
one output_text part per run of text, a function_call item per call. With `store` (the default) the response is kept in
a `ResponseStore` with its conversation so far (the thinking as the answer's `reasoning_content`, for the template to
keep or drop), so that the next turn names it instead of resending it; its prompt then begins with the tokens the last
turn already computed, which the prefix cache serves.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from server.api.chat_mapping import ChatMappedServing, ChatOutcome, named_event
from server.errors import APIError, invalid
from server.scheduling.generation import Generation
from server.api.metrics import ServerMetrics
from server.api.output_blocks import BlockEvent, OutputBlock, OutputBlocks
from server.api.responses.protocol import (FunctionCallItem, IncompleteDetails, InputItemList, InputTokensDetails,
    OutputMessage, OutputText, OutputTokensDetails, ReasoningItem, ReasoningText, ResponseDeleted, ResponseObject,
    ResponsesRequest, ResponseUsage, StoredInputItem)
from server.process.response_store import StoredResponses
from server.api.responses.input import (FIELD_NAMES, Message, chat_fields, echoed_tools, input_messages, new_id,
    stored_input_items)
from server.api.openai.serving import cancel
from server.scheduling.model_state import ModelState
from server.api.sse import sse_response
from server.api.openai.tool_calls import ToolPlan


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    input_items: list[StoredInputItem]  # this turn's own input, as GET .../input_items lists it
    conversation: list[Message]         # every turn up to this response's answer, without the instructions


@dataclass(frozen=True)
class _Turn:
    """One request's response as known before generating: what its response object echoes."""

    id: str
    created_at: int
    req: ResponsesRequest
    history: list[Message]
    inputs: list[Message]
    temperature: float
    top_p: float
    tools: ToolPlan | None                                  # the plan the output's calls are parsed with
    item_ids: dict[int, str] = field(default_factory=dict)  # each output block's item id, made as it opens


ITEM_ID_PREFIXES = {"reasoning": "rs", "text": "msg", "call": "fc"}
OutputItem = ReasoningItem | OutputMessage | FunctionCallItem


def _item_id(turn: _Turn, index: int, block: OutputBlock) -> str:
    return turn.item_ids.setdefault(index, new_id(ITEM_ID_PREFIXES[block.kind]))


def output_item(block: OutputBlock, item_id: str, status: str) -> OutputItem:
    if block.kind == "reasoning":
        return ReasoningItem(id=item_id, status=status, content=[ReasoningText(text=block.text)])
    if block.kind == "text":
        return OutputMessage(id=item_id, status=status, content=[OutputText(text=block.text)])
    return FunctionCallItem(id=item_id, call_id=block.call_id, name=block.name, arguments=block.text, status=status)


def opened_item(block: OutputBlock, item_id: str) -> OutputItem:
    """An item as output_item.added announces it: in progress, nothing written yet."""
    if block.kind == "reasoning":
        return ReasoningItem(id=item_id, status="in_progress", content=[])
    if block.kind == "text":
        return OutputMessage(id=item_id, status="in_progress", content=[])
    return FunctionCallItem(id=item_id, call_id=block.call_id, name=block.name, arguments="", status="in_progress")


def _status(outcome: ChatOutcome) -> str:
    return "incomplete" if outcome.finish_reason == "length" else "completed"


def _answer(blocks: OutputBlocks) -> Message:
    """The assistant turn the output is in the stored conversation (its thinking as `reasoning_content`)."""
    calls = [{"id": b.call_id, "type": "function", "function": {"name": b.name, "arguments": b.text}}
             for b in blocks.calls]
    thought = {"reasoning_content": blocks.reasoning} if blocks.reasoning else {}
    if not calls:
        return {"role": "assistant", "content": blocks.text, **thought}
    return {"role": "assistant", "content": blocks.text or None, "tool_calls": calls, **thought}


class StoredResponseReads:
    """GET / DELETE of stored responses, and their input items: what needs the store alone, not a model."""

    def __init__(self, store: StoredResponses) -> None:
        self.store = store

    async def _stored(self, response_id: str) -> StoredResponse:
        stored = await self.store.get(response_id)
        if stored is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id",
                           code="response_not_found")
        return stored

    async def retrieve(self, response_id: str) -> ResponseObject:
        return (await self._stored(response_id)).response

    async def delete(self, response_id: str) -> ResponseDeleted:
        await self._stored(response_id)
        await self.store.delete(response_id)
        return ResponseDeleted(id=response_id)

    async def input_items(self, response_id: str, limit: int, order: str, after: str | None) -> InputItemList:
        items = (await self._stored(response_id)).input_items
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


class ResponsesServing(ChatMappedServing, StoredResponseReads):
    """POST /v1/responses, and GET / DELETE of the responses it stored."""

    field_names = FIELD_NAMES

    def __init__(self, state: ModelState, metrics: ServerMetrics, store: StoredResponses) -> None:
        super().__init__(state, metrics)
        self.store = store

    async def create(self, req: ResponsesRequest, request: Request) -> ResponseObject | Any:
        arrival = time.perf_counter()
        self.check_model(req.model)
        self.log_unknown_fields(req)
        history = await self._history(req.previous_response_id)
        inputs = input_messages(req.input)
        chat = self.chat_request(chat_fields(req, history, inputs))
        rid = new_id("resp")
        gen, tools = await self.start(chat, rid, arrival)
        turn = _Turn(rid, int(time.time()), req, history, inputs, gen.params.temperature, gen.params.top_p, tools)
        if req.stream:
            numbers = itertools.count()
            return sse_response(self.guarded(self._stream(gen, turn, numbers), self._failure(numbers)),
                                on_close=lambda: cancel([gen]), send_timeout=self.state.stream_timeout)
        outcome = await self.collect(gen, request)
        blocks = OutputBlocks(tools)
        blocks.push(outcome.text, outcome.reasoning)
        blocks.finish()
        return await self._finish(turn, outcome, blocks)

    async def _history(self, previous_id: str | None) -> list[Message]:
        if previous_id is None:
            return []
        stored = await self.store.get(previous_id)
        if stored is None:
            raise APIError(404, f"Previous response with id '{previous_id}' not found.",
                           param="previous_response_id", code="previous_response_not_found")
        return stored.conversation

    def _response(self, turn: _Turn, status: str, output: list[OutputItem],
                  usage: ResponseUsage | None) -> ResponseObject:
        req = turn.req
        fmt = req.text.format if req.text is not None else None
        text = {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}}
        return ResponseObject(
            id=turn.id, created_at=turn.created_at, status=status, model=req.model, output=output,
            output_text="".join(part.text for item in output if isinstance(item, OutputMessage)
                                for part in item.content),
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            previous_response_id=req.previous_response_id, store=req.store, temperature=turn.temperature,
            top_p=turn.top_p, tool_choice=req.tool_choice if req.tool_choice is not None else "auto",
            tools=echoed_tools(req), text=text, usage=usage, metadata=req.metadata or {}, user=req.user,
            reasoning=req.reasoning.model_dump(exclude_none=True) if req.reasoning is not None else None)

    def _output(self, turn: _Turn, blocks: OutputBlocks, status: str) -> list[OutputItem]:
        """The output items: every block complete but the last, which ends as the response does."""
        last = len(blocks.blocks) - 1
        return [output_item(b, _item_id(turn, i, b), status if i == last else "completed")
                for i, b in enumerate(blocks.blocks)]

    async def _finish(self, turn: _Turn, outcome: ChatOutcome, blocks: OutputBlocks) -> ResponseObject:
        """The finished response, stored when the request asked for it."""
        status = _status(outcome)
        usage = ResponseUsage(input_tokens=outcome.prompt_tokens,
                              input_tokens_details=InputTokensDetails(cached_tokens=outcome.cached_tokens,
                                                                      cache_write_tokens=self._written(outcome)),
                              output_tokens=outcome.completion_tokens,
                              output_tokens_details=OutputTokensDetails(reasoning_tokens=outcome.reasoning_tokens),
                              total_tokens=outcome.prompt_tokens + outcome.completion_tokens)
        response = self._response(turn, status, self._output(turn, blocks, status), usage)
        if turn.req.store:
            await self.store.put(turn.id, StoredResponse(response, stored_input_items(turn.req.input),
                                                   [*turn.history, *turn.inputs, _answer(blocks)]))
        return response

    def _written(self, outcome: ChatOutcome) -> int:
        """The prompt's whole blocks past those read from the prefix cache: computed here, and kept there."""
        blocks = self.model.blocks
        if not blocks.prefix_caching:
            return 0
        return max(0, outcome.prompt_tokens // blocks.block_size * blocks.block_size - outcome.cached_tokens)

    async def _stream(self, gen: Generation, turn: _Turn, numbers: itertools.count) -> AsyncIterator[dict[str, str]]:
        """The published event order: created, in_progress, then for each output item as it is written its
        opening (output_item.added, and content_part.added for a reasoning item or a message), its deltas
        (reasoning_text.delta, output_text.delta or function_call_arguments.delta) and its closing
        (reasoning_text.done or output_text.done, and content_part.done; or function_call_arguments.done; then
        output_item.done), and completed (or incomplete, when cut by max_output_tokens)."""

        def event(kind: str, **fields: Any) -> dict[str, str]:
            return named_event(kind, {"type": kind, "sequence_number": next(numbers), **fields})

        started = self._response(turn, "in_progress", [], None).model_dump()
        yield event("response.created", response=started)
        yield event("response.in_progress", response=started)
        blocks = OutputBlocks(turn.tools)
        outcome = ChatOutcome()
        async with aclosing(self.coalesced(gen, outcome)) as pieces:
            async for piece in pieces:
                for change in blocks.push(piece.text, piece.reasoning):
                    for e in self._item_events(turn, change, "completed", event):
                        yield e
        status = _status(outcome)
        for change in blocks.push("") + blocks.finish():
            last = change.index == len(blocks.blocks) - 1
            for e in self._item_events(turn, change, status if last else "completed", event):
                yield e
        response = await self._finish(turn, outcome, blocks)
        kind = "response.completed" if response.status == "completed" else "response.incomplete"
        yield event(kind, response=response.model_dump())

    @staticmethod
    def _item_events(turn: _Turn, change: BlockEvent, status: str,
                     event: Callable[..., dict[str, str]]) -> Iterator[dict[str, str]]:
        """The events of one change to an output item (`status`: the item's, when this closes it)."""
        block, index = change.block, change.index
        item_id = _item_id(turn, index, block)
        where = {"item_id": item_id, "output_index": index}
        # the text of a reasoning item or a message is its content part 0, of a call its arguments
        parted = {"reasoning": "reasoning_text", "text": "output_text"}.get(block.kind)
        logprobs = {"logprobs": []} if block.kind == "text" else {}  # output_text's events carry them
        if change.kind == "open":
            yield event("response.output_item.added", output_index=index,
                        item=opened_item(block, item_id).model_dump())
            if parted is not None:
                empty = ReasoningText(text="") if block.kind == "reasoning" else OutputText(text="")
                yield event("response.content_part.added", **where, content_index=0, part=empty.model_dump())
        elif change.kind == "delta" and parted is None:
            yield event("response.function_call_arguments.delta", **where, delta=change.delta)
        elif change.kind == "delta":
            yield event(f"response.{parted}.delta", **where, content_index=0, delta=change.delta, **logprobs)
        else:
            item = output_item(block, item_id, status)
            if parted is not None:
                yield event(f"response.{parted}.done", **where, content_index=0, text=block.text, **logprobs)
                yield event("response.content_part.done", **where, content_index=0,
                            part=item.content[0].model_dump())
            else:
                yield event("response.function_call_arguments.done", **where, name=block.name, arguments=block.text)
            yield event("response.output_item.done", output_index=index, item=item.model_dump())

    @staticmethod
    def _failure(numbers: itertools.count) -> Callable[[APIError], list[dict[str, str]]]:
        """A failure after the stream started: the published `error` event, numbered in the stream's sequence."""
        return lambda e: [named_event("error", {"type": "error", "sequence_number": next(numbers), "code": e.code,
                                                "message": e.message, "param": e.param})]
