"""POST /v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens, on the chat path.

A request maps onto a chat completion (`chat_fields`): `system` as the system message, then the turns (an assistant's
tool_use blocks as its `tool_calls`, a user's tool_result blocks as `tool` messages), and the tools and tool_choice in
chat's shape, so the output is held to the same grammar and its calls parsed by the same parser. The answer's blocks
(`server.api.output_blocks`) are text and tool_use blocks, with `stop_reason` tool_use (calls made), end_turn (an end
token), stop_sequence (naming it) or max_tokens. A reasoning model's thinking opens the answer as a thinking block when
`thinking` enables it (its budget_tokens the chat's thinking_token_budget), and is left out otherwise; `thinking`
disabled also asks the chat template to skip the thinking (`enable_thinking: false`, as Qwen3's template reads it). An
assistant's thinking blocks given back are that turn's `reasoning_content`. Anthropic counts cache reads apart from the
input: `usage.input_tokens` are the prompt tokens computed for this request, `cache_read_input_tokens` those the prefix
cache served.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request

from server.api.chat_mapping import ChatMappedServing, ChatOutcome, named_event
from server.errors import APIError, invalid
from server.scheduling.generation import Generation
from server.api.output_blocks import BlockEvent, OutputBlock, OutputBlocks, call_input
from server.api.anthropic.protocol import (AnthropicConversation, AnthropicMessage, AnthropicResponseText,
    AnthropicThinking, AnthropicToolUse, AnthropicUsage, CountTokensRequest, MessageResponse, MessagesRequest,
    StopReason, TextBlock, ThinkingBlock, TokenCount, ToolChoice, ToolResultBlock, joined)
from server.api.openai.serving import cancel
from server.api.sse import sse_response
from server.api.openai.tool_calls import ToolPlan

CHAT_TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic client tool as chat's function tool; a 400 naming the field for a server tool or no schema."""
    kind = tool.get("type", "custom")
    if kind != "custom":
        raise invalid(f"tools of type {kind!r} (server tools) are not supported: only client tools with an "
                      "input_schema", param=f"tools.{i}.type")
    if "input_schema" not in tool:
        raise invalid("Field required", param=f"tools.{i}.input_schema")
    function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    if "description" in tool:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def tool_choice_fields(choice: ToolChoice) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if choice.type == "tool":
        if choice.name is None:
            raise invalid("a tool_choice of type 'tool' names the tool", param="tool_choice.name")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = CHAT_TOOL_CHOICE[choice.type]
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    return fields


def _result_text(block: ToolResultBlock) -> str:
    text = joined(block.content)
    return f"Error: {text}" if block.is_error else text


def chat_turns(i: int, m: AnthropicMessage) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: tool_result blocks become `tool` messages where they stand, the text
    around them user messages; an assistant's tool_use blocks its `tool_calls`, its thinking blocks its
    `reasoning_content` (redacted thinking is not read)."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    out: list[dict[str, Any]] = []
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    thinking: list[str] = []
    for j, block in enumerate(m.content):
        if isinstance(block, TextBlock):
            text.append(block.text)
            continue
        wanted = "user" if block.type == "tool_result" else "assistant"
        if m.role != wanted:
            raise invalid(f"{block.type} blocks belong in {wanted} messages", param=f"messages.{i}.content.{j}")
        if isinstance(block, ToolResultBlock):
            if text:
                out.append({"role": "user", "content": "".join(text)})
                text = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_text(block)})
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
        elif block.type == "tool_use":
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
    thought = {"reasoning_content": "".join(thinking)} if thinking else {}
    if calls:
        out.append({"role": "assistant", "content": "".join(text), "tool_calls": calls, **thought})
    elif text or thought or not out:
        out.append({"role": m.role, "content": "".join(text), **thought})
    return out


def conversation_fields(req: AnthropicConversation) -> dict[str, Any]:
    """The chat messages, tools and tool_choice of an Anthropic conversation: `system` first, then each turn."""
    if req.messages[-1].role == "assistant":
        raise invalid("a last message from the assistant (a prefill for the answer to continue) is not "
                      "supported yet: end with a user message", param="messages")
    system = [{"role": "system", "content": joined(req.system)}] if req.system is not None else []
    turns = [message for i, m in enumerate(req.messages) for message in chat_turns(i, m)]
    fields: dict[str, Any] = {"model": req.model, "messages": system + turns}
    if req.tools is not None:
        fields["tools"] = [chat_tool(i, t) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        fields.update(tool_choice_fields(req.tool_choice))
    return fields


def chat_fields(req: MessagesRequest) -> dict[str, Any]:
    """The chat completion request that a Messages request is."""
    fields = {**conversation_fields(req), "max_completion_tokens": req.max_tokens, "stop": req.stop_sequences,
              "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "stream": req.stream}
    if req.thinking is not None and req.thinking.type == "enabled":
        fields["thinking_token_budget"] = req.thinking.budget_tokens
    elif req.thinking is not None and req.thinking.type == "disabled":
        fields["chat_template_kwargs"] = {"enable_thinking": False}
    return fields


def shows_thinking(req: MessagesRequest) -> bool:
    """Whether the answer opens with the thinking (a thinking block), or leaves it out."""
    return req.thinking is not None and req.thinking.type != "disabled"


def thinking_text(req: MessagesRequest, text: str) -> str:
    """A thinking block's text: the thinking, or nothing with display omitted."""
    return "" if req.thinking is not None and req.thinking.display == "omitted" else text


def stop_reason(outcome: ChatOutcome, blocks: OutputBlocks) -> tuple[StopReason, str | None]:
    """Anthropic's stop_reason and stop_sequence for how the choice ended."""
    if outcome.finish_reason == "length":
        return "max_tokens", None
    if blocks.calls:
        return "tool_use", None
    if isinstance(outcome.stop_reason, str):
        return "stop_sequence", outcome.stop_reason
    return "end_turn", None


def usage(outcome: ChatOutcome) -> AnthropicUsage:
    return AnthropicUsage(input_tokens=outcome.prompt_tokens - outcome.cached_tokens,
                          output_tokens=outcome.completion_tokens, cache_read_input_tokens=outcome.cached_tokens)


def content_block(req: MessagesRequest, block: OutputBlock) -> AnthropicThinking | AnthropicResponseText | \
        AnthropicToolUse:
    if block.kind == "reasoning":
        return AnthropicThinking(thinking=thinking_text(req, block.text))
    if block.kind == "text":
        return AnthropicResponseText(text=block.text)
    return AnthropicToolUse(id=block.call_id, name=block.name, input=call_input(block))


class MessagesServing(ChatMappedServing):
    """Anthropic's Messages API over the served model's chat template."""

    field_names = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences",
                   "tools.*.function.parameters": "tools.*.input_schema", "tools.*.function": "tools.*",
                   "tool_choice.function": "tool_choice",
                   "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
                   "thinking_token_budget": "thinking.budget_tokens"}

    async def create(self, req: MessagesRequest, request: Request) -> MessageResponse | Any:
        arrival = time.perf_counter()
        self.check_model(req.model)
        self.log_unknown_fields(req)
        chat = self.chat_request(chat_fields(req))
        rid = f"msg_{uuid.uuid4().hex}"
        gen, tools = await self.start(chat, rid, arrival)
        if req.stream:
            return sse_response(self.guarded(self._stream(gen, req, tools), self._failure),
                                on_close=lambda: cancel([gen]), send_timeout=self.state.stream_timeout)
        outcome = await self.collect(gen, request)
        blocks = OutputBlocks(tools, tool_use_id)
        blocks.push(outcome.text, outcome.reasoning if shows_thinking(req) else "")
        blocks.finish()
        reason, sequence = stop_reason(outcome, blocks)
        return MessageResponse(id=rid, model=req.model, content=[content_block(req, b) for b in blocks.blocks],
                               stop_reason=reason, stop_sequence=sequence, usage=usage(outcome))

    async def count_tokens(self, req: CountTokensRequest) -> TokenCount:
        """The prompt's tokens: the conversation and the tools, as the chat template writes them."""
        self.check_model(req.model)
        self.log_unknown_fields(req)
        chat = self.chat_request(conversation_fields(req))
        plan = self.output_plan(chat)
        return TokenCount(input_tokens=len(await self.prompt_ids(chat, plan.tools)))

    async def _stream(self, gen: Generation, req: MessagesRequest,
                      tools: ToolPlan | None) -> AsyncIterator[dict[str, str]]:
        """message_start, then each block as it is written (content_block_start, ping after the first, its
        deltas, a thinking block's signature_delta, content_block_stop), message_delta with the stop reason and
        the usage totals, message_stop."""
        start = MessageResponse(id=gen.request_id, model=req.model, content=[], stop_reason=None, stop_sequence=None,
                                usage=AnthropicUsage(input_tokens=len(gen.prompt_ids), output_tokens=0))
        yield named_event("message_start", {"type": "message_start", "message": start.model_dump()})
        blocks = OutputBlocks(tools, tool_use_id)
        outcome = ChatOutcome()
        shown = shows_thinking(req)
        async with aclosing(self.coalesced(gen, outcome)) as pieces:
            async for piece in pieces:
                for change in blocks.push(piece.text, piece.reasoning if shown else ""):
                    for e in self._block_events(req, change):
                        yield e
        for change in blocks.push("") + blocks.finish():
            for e in self._block_events(req, change):
                yield e
        reason, sequence = stop_reason(outcome, blocks)
        yield named_event("message_delta", {"type": "message_delta",
                                            "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                            "usage": usage(outcome).model_dump()})
        yield named_event("message_stop", {"type": "message_stop"})

    @staticmethod
    def _block_events(req: MessagesRequest, change: BlockEvent) -> list[dict[str, str]]:
        block, index = change.block, change.index

        def delta(body: dict[str, str]) -> dict[str, str]:
            return named_event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": body})

        if change.kind == "open":
            opened = AnthropicThinking(thinking="") if block.kind == "reasoning" else \
                AnthropicResponseText(text="") if block.kind == "text" else \
                AnthropicToolUse(id=block.call_id, name=block.name, input={})
            start = named_event("content_block_start", {"type": "content_block_start", "index": index,
                                                        "content_block": opened.model_dump()})
            return [start, named_event("ping", {"type": "ping"})] if index == 0 else [start]
        if change.kind == "delta":
            if block.kind == "reasoning":
                piece = thinking_text(req, change.delta)
                return [delta({"type": "thinking_delta", "thinking": piece})] if piece else []
            return [delta({"type": "text_delta", "text": change.delta} if block.kind == "text" else
                          {"type": "input_json_delta", "partial_json": change.delta})]
        stop = named_event("content_block_stop", {"type": "content_block_stop", "index": index})
        if block.kind == "reasoning":
            return [delta({"type": "signature_delta", "signature": AnthropicThinking(thinking="").signature}), stop]
        return [stop]

    @staticmethod
    def _failure(error: APIError) -> list[dict[str, str]]:
        """A failure after the stream started: Anthropic's `error` event."""
        return [named_event("error", error.anthropic_body())]
