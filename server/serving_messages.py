"""POST /v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens, on the chat path.

A request maps onto a chat completion (`chat_fields`): `system` as the system message, then the turns; the answer
is one text block, with `stop_reason` end_turn (an end token), stop_sequence (naming it) or max_tokens. Anthropic
counts cache reads apart from the input: `usage.input_tokens` are the prompt tokens computed for this request,
`cache_read_input_tokens` those the prefix cache served.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request

from .chat_mapping import ChatMappedServing, ChatOutcome, named_event
from .errors import APIError, invalid
from .generation import Generation
from .protocol_anthropic import (AnthropicConversation, AnthropicResponseText, AnthropicUsage, CountTokensRequest,
                                 MessageResponse, MessagesRequest, StopReason, TokenCount, joined)
from .serving import cancel
from .sse import sse_response


def refuse_unsupported(req: AnthropicConversation) -> None:
    """400 for what needs tool calling (issue 14's machinery, not wired in yet) or continuing a prefill."""
    if req.tools:
        raise invalid("tools are not supported yet", param="tools")
    if req.tool_choice is not None and req.tool_choice.get("type") not in ("auto", "none"):
        raise invalid("tool_choice other than 'auto' or 'none' needs tools, which are not supported yet",
                      param="tool_choice")
    if req.messages[-1].role == "assistant":
        raise invalid("a last message from the assistant (a prefill for the answer to continue) is not "
                      "supported yet: end with a user message", param="messages")


def conversation_fields(req: AnthropicConversation) -> dict[str, Any]:
    """The chat messages of an Anthropic conversation: `system` first, then each turn's text."""
    refuse_unsupported(req)
    system = [{"role": "system", "content": joined(req.system)}] if req.system is not None else []
    turns = [{"role": m.role, "content": joined(m.content)} for m in req.messages]
    return {"model": req.model, "messages": system + turns}


def chat_fields(req: MessagesRequest) -> dict[str, Any]:
    """The chat completion request that a Messages request is."""
    return {**conversation_fields(req), "max_completion_tokens": req.max_tokens, "stop": req.stop_sequences,
            "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "stream": req.stream}


def stop_reason(outcome: ChatOutcome) -> tuple[StopReason, str | None]:
    """Anthropic's stop_reason and stop_sequence for how the choice ended."""
    if outcome.finish_reason == "length":
        return "max_tokens", None
    if isinstance(outcome.stop_reason, str):
        return "stop_sequence", outcome.stop_reason
    return "end_turn", None


def usage(outcome: ChatOutcome) -> AnthropicUsage:
    return AnthropicUsage(input_tokens=outcome.prompt_tokens - outcome.cached_tokens,
                          output_tokens=outcome.completion_tokens, cache_read_input_tokens=outcome.cached_tokens)


class MessagesServing(ChatMappedServing):
    """Anthropic's Messages API over the served model's chat template."""

    field_names = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences"}

    async def create(self, req: MessagesRequest, request: Request) -> MessageResponse | Any:
        arrival = time.perf_counter()
        self.check_model(req.model)
        self.log_unknown_fields(req)
        chat = self.chat_request(chat_fields(req))
        rid = f"msg_{uuid.uuid4().hex}"
        gen = await self.start(chat, rid, arrival)
        if req.stream:
            return sse_response(self.guarded(self._stream(gen, req.model), self._failure),
                                on_close=lambda: cancel([gen]), send_timeout=self.state.stream_timeout)
        outcome = await self.collect(gen, request)
        reason, sequence = stop_reason(outcome)
        return MessageResponse(id=rid, model=req.model, content=[AnthropicResponseText(text=outcome.text)],
                               stop_reason=reason, stop_sequence=sequence, usage=usage(outcome))

    async def count_tokens(self, req: CountTokensRequest) -> TokenCount:
        self.check_model(req.model)
        self.log_unknown_fields(req)
        chat = self.chat_request(conversation_fields(req))
        return TokenCount(input_tokens=len(await self.prompt_ids(chat)))

    async def _stream(self, gen: Generation, model: str) -> AsyncIterator[dict[str, str]]:
        """message_start, one text block (start, ping, deltas, stop), message_delta with the stop reason and the
        usage totals, message_stop."""
        start = MessageResponse(id=gen.request_id, model=model, content=[], stop_reason=None, stop_sequence=None,
                                usage=AnthropicUsage(input_tokens=len(gen.prompt_ids), output_tokens=0))
        yield named_event("message_start", {"type": "message_start", "message": start.model_dump()})
        yield named_event("content_block_start", {"type": "content_block_start", "index": 0,
                                                  "content_block": {"type": "text", "text": ""}})
        yield named_event("ping", {"type": "ping"})
        outcome, pending = ChatOutcome(), ""
        # Everything already waiting is read before anything is sent: a reader that falls behind gets one delta
        # for several tokens.
        async with aclosing(self.events([gen])) as events:
            async for _, event in events:
                pending += outcome.add(event)
                if pending and gen.channel.empty():
                    yield self._delta(pending)
                    pending = ""
        if pending:
            yield self._delta(pending)
        yield named_event("content_block_stop", {"type": "content_block_stop", "index": 0})
        reason, sequence = stop_reason(outcome)
        yield named_event("message_delta", {"type": "message_delta",
                                            "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                            "usage": usage(outcome).model_dump()})
        yield named_event("message_stop", {"type": "message_stop"})

    @staticmethod
    def _delta(text: str) -> dict[str, str]:
        return named_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                   "delta": {"type": "text_delta", "text": text}})

    @staticmethod
    def _failure(error: APIError) -> list[dict[str, str]]:
        """A failure after the stream started: Anthropic's `error` event."""
        return [named_event("error", error.anthropic_body())]
