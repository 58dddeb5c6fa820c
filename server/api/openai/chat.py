"""POST /v1/chat/completions: messages → chat template → Generation → a chat.completion or its SSE chunks."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request

from server.errors import APIError, invalid
from server.scheduling.generation import ChoiceDelta, Generation, GenerationDone, PositionLogprobs
from server.api.openai.protocol import (ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
    FunctionCall, ResponseMessage, TokenLogprob, ToolCall)
from server.api.openai.serving import OpenAIServing, cancel, prompt_work, request_id
from server.api.sse import DONE, event_json, sse_response
from server.api.openai.preparation import OutputPlan, chat_prompt_ids
from server.api.openai.tool_calls import ToolPlan
from server.api.harmony_calls import HarmonyCallParser
from server.api.tool_parser import ToolCallFragment, ToolCallParser


def finish_reason(reason: str | None, parser: ToolCallParser | HarmonyCallParser | None) -> str | None:
    """A choice that ended after making calls (rather than by length) finishes with "tool_calls"."""
    return "tool_calls" if reason == "stop" and parser is not None and parser.calls else reason


def tool_call_deltas(deltas: list[ToolCallFragment]) -> list[dict[str, Any]]:
    """OpenAI's `delta.tool_calls`: id, type and name in a call's first delta, argument fragments after."""
    out = []
    for d in deltas:
        entry: dict[str, Any] = {"index": d.index}
        function: dict[str, Any] = {"arguments": d.arguments}
        if d.id is not None:
            entry.update(id=d.id, type="function")
            function["name"] = d.name
        entry["function"] = function
        out.append(entry)
    return out


class ChatServing(OpenAIServing):
    """Chat completions over the served model's chat template."""

    async def create(self, req: ChatCompletionRequest, request: Request) -> ChatCompletionResponse | Any:
        arrival = time.perf_counter()
        self.check_model(req.model)
        self.log_unknown_fields(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise invalid("top_logprobs requires logprobs to be true", param="top_logprobs")

        async def prompt(plan: OutputPlan) -> list[list[int]]:
            return [await prompt_work(chat_prompt_ids, self.state, req.messages, req.add_generation_prompt,
                                      plan.tools, req.chat_template_kwargs, req.reasoning_effort)]

        prepared = await self.prepare(req, prompt, rid=request_id("chatcmpl"), arrival=arrival)
        gen, calls = prepared.gens[0], prepared.plan.calls
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return sse_response(self._stream(gen, req.model, include_usage, calls, req.include_reasoning),
                                on_close=lambda: cancel([gen]),
                                send_timeout=self.state.stream_timeout)
        return await self._complete(gen, req, request, calls)

    def _logprobs(self, entries: list[PositionLogprobs]) -> list[TokenLogprob]:
        out = []
        for e in entries:
            top = [self.top_logprob(t, lp) for t, lp in e.top]
            base = self.top_logprob(e.token, e.logprob)
            out.append(TokenLogprob(token=base.token, logprob=base.logprob, bytes=base.bytes, top_logprobs=top))
        return out

    async def _complete(self, gen: Generation, req: ChatCompletionRequest, request: Request,
                        tools: ToolPlan | None) -> ChatCompletionResponse:
        texts, thoughts = [""] * gen.n, [""] * gen.n
        finish: list[str | None] = [None] * gen.n
        logprobs: list[list[PositionLogprobs]] = [[] for _ in range(gen.n)]
        usage = None
        async with aclosing(self.events([gen], request)) as events:
            async for _, event in events:
                if isinstance(event, ChoiceDelta):
                    texts[event.index] += event.text
                    thoughts[event.index] += event.reasoning
                    logprobs[event.index] += event.logprobs or []
                    finish[event.index] = event.finish_reason or finish[event.index]
                elif isinstance(event, GenerationDone):
                    usage = self.done_usage(gen, event)
        if usage is None:  # the client went away; nobody reads this
            raise APIError(499, "client closed request")
        shown = thoughts if gen.reasoning is not None and req.include_reasoning else [""] * gen.n
        choices = [ChatChoice(index=i, message=self._message(texts[i], tools, shown[i]), finish_reason=finish[i],
                              logprobs=ChatLogprobs(content=self._logprobs(logprobs[i])) if req.logprobs else None)
                   for i in range(gen.n)]
        if tools is not None:
            for choice in choices:
                if choice.message.tool_calls and choice.finish_reason == "stop":
                    choice.finish_reason = "tool_calls"
        return ChatCompletionResponse(id=gen.request_id, model=req.model, choices=choices, usage=usage,
                                      system_fingerprint=self.state.fingerprint)

    @staticmethod
    def _message(text: str, tools: ToolPlan | None, reasoning: str = "") -> ResponseMessage:
        """A choice's message: its text, or with tools the calls it made and the text around them (content null
        when there is only a call); and its thinking, if any."""
        thought = {"reasoning": reasoning, "reasoning_content": reasoning} if reasoning else {}
        if tools is None:
            return ResponseMessage(content=text, **thought)
        parser = tools.parser()
        parser.push(text)
        parser.finish()
        calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in parser.calls]
        content = parser.content if parser.content.strip() or not calls else None
        return ResponseMessage(content=content, tool_calls=calls or None, **thought)

    async def _stream(self, gen: Generation, model: str, include_usage: bool, tools: ToolPlan | None = None,
                      include_reasoning: bool = True) -> AsyncIterator[str | list[str]]:
        created = int(time.time())
        want_logprobs = gen.params.logprobs

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None, last: bool = False) -> str:
            body: dict[str, Any] = {"id": gen.request_id, "object": "chat.completion.chunk", "created": created,
                                    "model": model, "system_fingerprint": self.state.fingerprint, "choices": choices}
            if include_usage:
                body["usage"] = usage if last else None
            return event_json(body)

        def choice(index: int, delta: dict[str, Any], pending: list[PositionLogprobs] | None = None,
                   finish_reason: str | None = None) -> dict[str, Any]:
            lp = None
            if want_logprobs and pending is not None:
                lp = {"content": [m.model_dump() for m in self._logprobs(pending)], "refusal": None}
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}

        # What arrived for each choice since the last chunks went out. Everything already waiting is read before
        # anything is sent, so a reader that falls behind sends one chunk per choice for several tokens.
        texts, thoughts, pending = [""] * gen.n, [""] * gen.n, [[] for _ in range(gen.n)]
        finish: list[str | None] = [None] * gen.n
        parsers = [tools.parser() if tools is not None else None for _ in range(gen.n)]
        usage = None

        def flush() -> list[str]:
            out = []
            for i in range(gen.n):
                if thoughts[i]:  # the thinking goes before the answer it precedes (vLLM's field and DeepSeek's)
                    out.append(chunk([choice(i, {"reasoning": thoughts[i], "reasoning_content": thoughts[i]})]))
                    thoughts[i] = ""
                parser, calls = parsers[i], []
                if parser is not None:  # the text as content and tool-call deltas
                    content, deltas = parser.push(texts[i])
                    if finish[i] is not None:
                        tail, more = parser.finish()
                        content, deltas = content + tail, deltas + more
                    texts[i], calls = content, tool_call_deltas(deltas)
                if texts[i] or calls:
                    delta = {"content": texts[i]} if texts[i] else {}
                    if calls:
                        delta["tool_calls"] = calls
                    out.append(chunk([choice(i, delta, pending[i])]))
                    texts[i], pending[i] = "", []
                if finish[i] is not None:
                    reason = finish_reason(finish[i], parser)
                    out.append(chunk([choice(i, {}, pending[i] if pending[i] else None, reason)]))
                    finish[i], pending[i] = None, []
            if usage is not None:
                out.append(chunk([], usage, last=True))
            return out

        try:
            async with aclosing(self.events([gen])) as events:
                for i in range(gen.n):
                    yield chunk([choice(i, {"role": "assistant", "content": ""})])
                async for _, event in events:
                    if isinstance(event, ChoiceDelta):
                        i = event.index
                        pending[i] += event.logprobs or []
                        texts[i] += event.text
                        if include_reasoning:
                            thoughts[i] += event.reasoning
                        finish[i] = event.finish_reason
                    elif isinstance(event, GenerationDone) and include_usage:
                        usage = self.done_usage(gen, event).model_dump()
                    if gen.channel.empty():
                        lines = flush()
                        if lines:
                            yield lines  # every choice's news in one write
        except APIError as e:
            yield self.stream_error(e)
        yield DONE
