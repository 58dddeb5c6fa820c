"""A Responses request as the chat completion request it is: input items as chat messages, and the tools,
tool_choice and text.format in chat's shape; and the input as GET /v1/responses/{id}/input_items lists it.

- `instructions` is the system message, then the turns of `previous_response_id`, then `input`: message items
  as messages, `function_call` items as the `tool_calls` of an assistant message (consecutive calls, and calls
  right after an assistant message, make one turn, as the model wrote them), `function_call_output` items as
  `tool` messages; `reasoning` items (an earlier answer's thinking) as the `reasoning_content` of the assistant
  turn that follows them (one of their own, with empty content, where none follows).
- Function tools are flat (`{"type": "function", "name", "parameters", ...}`): chat nests them under `function`.
  `tool_choice` `{"type": "function", "name"}` is chat's `{"type": "function", "function": {"name"}}`.
- `text.format` json_schema / json_object is chat's `response_format`; `reasoning.effort` is chat's
  `reasoning_effort` (a thinking budget); `thinking_token_budget` and `chat_template_kwargs` (emberserve's extensions)
  are chat's own.
Errors that chat's validation raises are renamed back (`ResponsesServing.field_names`).
"""
from __future__ import annotations

import uuid
from typing import Any

from server.errors import invalid
from server.api.responses.protocol import (FunctionCallInput, FunctionCallItem, FunctionCallOutputInput,
    FunctionCallOutputItem, InputItem, InputMessage, InputMessageItem, ReasoningInput, ReasoningItem, ReasoningText,
    ResponsesRequest, StoredInputItem, TextConfig)

Message = dict[str, Any]  # one chat message, as the chat request takes it

# Chat's fields (and paths into them) as the Responses API names them, for the errors chat's steps raise.
FIELD_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
               "response_format.json_schema": "text.format", "response_format": "text.format",
               "tools.*.function": "tools.*", "tool_choice.function": "tool_choice",
               "reasoning_effort": "reasoning.effort"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_messages(items: str | list[InputItem]) -> list[Message]:
    """The request's input as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[Message] = []
    thinking: str | None = None  # reasoning items' text, for the assistant turn they begin

    def thought() -> dict[str, str]:
        nonlocal thinking
        given, thinking = thinking, None
        return {} if given is None else {"reasoning_content": given}

    for item in items:
        if isinstance(item, ReasoningInput):
            thinking = (thinking or "") + item.text()
            continue
        if isinstance(item, FunctionCallInput):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if thinking is None and out and out[-1]["role"] == "assistant":  # the calls of the turn it began
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call], **thought()})
            continue
        if thinking is not None and not (isinstance(item, InputMessage) and item.role == "assistant"):
            out.append({"role": "assistant", "content": "", **thought()})  # thinking with no answer after it
        if isinstance(item, FunctionCallOutputInput):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        else:
            out.append({"role": item.role, "content": item.text(), **thought()})
    if thinking is not None:
        out.append({"role": "assistant", "content": "", **thought()})
    return out


def chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool as chat's; a 400 naming `tools.i.type` for any other type."""
    kind = tool.get("type")
    if kind != "function":
        raise invalid(f"tools.{i}.type: tools of type {kind!r} are not supported: only 'function' tools (the "
                      "server runs no hosted tools)", param=f"tools.{i}.type")
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function":
        raise invalid(f"tool_choice of type {choice.get('type')!r} is not supported: only 'none', 'auto', "
                      "'required' or {'type': 'function', 'name': ...}", param="tool_choice")
    return {"type": "function", "function": {"name": choice.get("name")}}


def response_format(text: TextConfig | None) -> dict[str, Any] | None:
    """text.format as chat's response_format (None: free text)."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise invalid("text.format.schema: a format of type json_schema needs a schema", param="text.format.schema")
    schema = {"name": fmt.name, "description": fmt.description, "schema": fmt.schema_, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def echoed_tools(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's tools as the response object echoes them (each a FunctionTool)."""
    fields = ("type", "name", "description", "parameters", "strict")
    return [{"parameters": None, "strict": None, **{k: t[k] for k in fields if k in t}} for t in req.tools or []]


def chat_fields(req: ResponsesRequest, history: list[Message], inputs: list[Message]) -> dict[str, Any]:
    """The chat completion request that a Responses request is."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    fields: dict[str, Any] = {
        "model": req.model, "messages": system + history + inputs, "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "preset": req.preset, "stream": req.stream,
        "response_format": response_format(req.text), "parallel_tool_calls": req.parallel_tool_calls,
        "reasoning_effort": req.reasoning.effort if req.reasoning is not None else None,
        "thinking_token_budget": req.thinking_token_budget, "chat_template_kwargs": req.chat_template_kwargs}
    if req.tools is not None:
        fields["tools"] = [chat_tool(i, t) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        fields["tool_choice"] = chat_tool_choice(req.tool_choice)
    return fields


def stored_input_items(items: str | list[InputItem]) -> list[StoredInputItem]:
    """The request's input as stored items, each with an id (its own, for an item given back with one)."""
    if isinstance(items, str):
        return [InputMessageItem(id=new_id("msg"), role="user", content=[{"type": "input_text", "text": items}])]
    out: list[StoredInputItem] = []
    for item in items:
        given = (item.model_extra or {}).get("id")
        if isinstance(item, FunctionCallInput):
            out.append(FunctionCallItem(id=given if isinstance(given, str) else new_id("fc"), call_id=item.call_id,
                                        name=item.name, arguments=item.arguments, status="completed"))
        elif isinstance(item, FunctionCallOutputInput):
            output = item.output if isinstance(item.output, str) else [p.model_dump() for p in item.output]
            out.append(FunctionCallOutputItem(id=given if isinstance(given, str) else new_id("fco"),
                                              call_id=item.call_id, output=output))
        elif isinstance(item, ReasoningInput):
            out.append(ReasoningItem(id=given if isinstance(given, str) else new_id("rs"),
                                     content=[ReasoningText(text=p.text) for p in item.content or []],
                                     status="completed"))
        else:
            out.append(_message_item(item))
    return out


def _message_item(item: InputMessage) -> InputMessageItem:
    if isinstance(item.content, str):
        kind = "output_text" if item.role == "assistant" else "input_text"
        content = [{"type": kind, "text": item.content}]
    else:
        content = [{"type": part.type, "text": part.text} for part in item.content]
    return InputMessageItem(id=new_id("msg"), role=item.role, content=content)
