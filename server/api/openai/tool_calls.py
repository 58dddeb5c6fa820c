"""Tool calling: `tools`, `tool_choice` and `parallel_tool_calls` → the prompt, the grammar and the parser.

The call format follows the model's chat template (`tool_format`):
- "hermes", for templates that write `<tool_call>` (Qwen2/2.5/3): the template gets `tools`; the model writes
  text, then `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks, one per call.
- "llama3", for Llama 3.x templates (header markers and tools): the template gets `tools`; a call is the whole
  output, `{"name": ..., "parameters": {...}}` (one call per turn).
- "generic", for templates without tool support (SmolLM2, Gemma 3), as llama-server's generic handler: a system
  prompt lists the tools and asks for JSON, `{"tool_call": {"name", "arguments"}}` (`{"tool_calls": [...]}` with
  parallel calls) or `{"response": "..."}`; the conversation's earlier calls and results are written the same way.
- "harmony", for gpt-oss's template (harmony's channels): the template gets `tools` and earlier turns' `thinking`
  (an assistant message with several calls becomes one message per call, each call's result right after it: the
  template writes one call per message and names a result by the call before it); the model writes a message to
  `functions.NAME` on the commentary channel, ended by `<|call|>`, which ends the output: one call per turn. The
  reasoning splitter hands the call on as harmony text (server/reasoning/harmony.py) and `HarmonyCallParser` reads
  it (server/api/harmony_calls.py).

The grammar (`ToolPlan.grammar`): `required` and a named function force calls whose arguments match the function's
schema; `auto` lets the model write text, and once a call starts (its marker, "{" for llama3) forces the call
(llguidance's lazy lexemes), or for "generic" lets it pick the response or the call envelope. `none` sends no
tools and no grammar: the model answers in text. With a JSON `response_format` as well, `auto` lets the model
answer with that JSON instead of text (the content is the JSON), or call; the forced choices only call.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from server.grammar.spec import JSON_FORMAT, GrammarSpec, StructuredOutputError
from server.api.openai.protocol import ChatMessage, NamedToolChoice, ToolDefinition
from server.api.openai.structured_outputs import check_json_schema
from server.api.harmony_calls import HarmonyCallParser
from server.api.tool_parser import ToolCallParser, ToolFormatName, new_call_id

__all__ = ["GENERIC_TOOL_PROMPT", "ToolPlan", "plan_tools", "template_messages", "tool_format"]

NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
GENERIC_TOOL_PROMPT = (
    "You can call the following tools. Each is given as a JSON object with its name, description and the JSON "
    "schema of its arguments:\n{tools}\n\n"
    "Respond in JSON format, either with `{call_key}` (a request to call tools) or with `response` (a reply to "
    "the user's request), for example:\n{example}\nor\n{{\"response\": \"...\"}}")


def tool_format(template: str) -> ToolFormatName:
    """The call format a chat template was trained on, by the markers it writes."""
    if "<|channel|>" in template and "<|call|>" in template:
        return "harmony"
    if HERMES_START in template:
        return "hermes"
    if "<|start_header_id|>" in template and ("tools" in template or "ipython" in template):
        return "llama3"
    return "generic"


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools make of its generation."""

    format: ToolFormatName
    tools: list[dict[str, Any]]       # OpenAI tool definitions, for the template (empty with choice "none")
    choice: Literal["none", "auto", "required", "named"]
    parallel: bool
    grammar: GrammarSpec | None
    json_response: bool = False       # an answer that is no call is JSON of the response_format's schema

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    def parser(self, new_id: Callable[[], str] = new_call_id) -> ToolCallParser | HarmonyCallParser:
        """A parser of one choice's output; `new_id` makes the calls' ids (the endpoint's own prefix)."""
        if self.format == "harmony":
            return HarmonyCallParser(new_id=new_id)
        return ToolCallParser(self.format, start_marker=HERMES_START, end_marker=HERMES_END,
                              json_response=self.json_response, new_id=new_id)


def _check_tools(tools: list[ToolDefinition]) -> None:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.function
        if fn.name in seen:
            raise StructuredOutputError(f"tools define the function {fn.name!r} twice", f"tools.{i}.function.name")
        seen.add(fn.name)
        if fn.parameters is None:
            continue
        param = f"tools.{i}.function.parameters"
        check_json_schema(fn.parameters, param)
        kind = fn.parameters.get("type", "object")
        if kind != "object":
            raise StructuredOutputError(f"a function's parameters must be a JSON schema of type object, got "
                                        f"{json.dumps(kind)}", param)


def _rebased(value: Any, base: str) -> Any:
    """`value` with every local reference ("#...") made relative to `base` instead of the document's root."""
    if isinstance(value, dict):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebased(v, base))
                for k, v in value.items()}
    if isinstance(value, list):
        return [_rebased(v, base) for v in value]
    return value


def _call_schema(tool: ToolDefinition, args_key: str, defs: dict[str, Any]) -> dict[str, Any]:
    """The schema of one call object. Parameters with local references ("#/$defs/...") move into `defs`, the
    root's $defs, so that their references still resolve inside the envelope."""
    fn = tool.function
    arguments = fn.parameters or NO_PARAMETERS
    if '"$ref": "#' in json.dumps(arguments):
        key = f"parameters_of_{fn.name}"
        defs[key] = _rebased(arguments, f"#/$defs/{key}")
        arguments = {"$ref": f"#/$defs/{key}"}
    return {"type": "object", "properties": {"name": {"const": fn.name}, args_key: arguments},
            "required": ["name", args_key], "additionalProperties": False}


def _with_defs(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "$defs": defs} if defs else schema


def _one_of(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _generic_envelope(calls: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    if parallel:
        return {"type": "object", "properties": {"tool_calls": {"type": "array", "items": _one_of(calls),
                                                                "minItems": 1}},
                "required": ["tool_calls"], "additionalProperties": False}
    return {"type": "object", "properties": {"tool_call": _one_of(calls)}, "required": ["tool_call"],
            "additionalProperties": False}


def _lark_json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({"x-guidance": JSON_FORMAT, **schema}, ensure_ascii=False)


def _harmony_grammar(tools: list[ToolDefinition]) -> GrammarSpec:
    """A forced harmony call: an analysis message or none, then a message to one of `tools` (its arguments under
    its schema) ended by <|call|>, as gpt-oss writes it."""
    defs: dict[str, Any] = {}
    calls = []
    for i, tool in enumerate(tools):
        schema = _call_schema(tool, "arguments", defs)["properties"]["arguments"]
        calls.append(f'call{i}: <|channel|> "commentary to=functions.{tool.function.name} " <|constrain|> "json" '
                     f"<|message|> {_lark_json(_with_defs(schema, defs))} <|call|>")
    choices = " | ".join(f"call{i}" for i in range(len(tools)))
    return GrammarSpec("lark", f"start: analysis? ({choices})\n"
                       'analysis: <|channel|> "analysis" <|message|> THOUGHT <|end|> <|start|> "assistant"\n'
                       "THOUGHT: /(.|\\n)*/\n" + "\n".join(calls), "tools")


def _grammar(fmt: ToolFormatName, tools: list[ToolDefinition], choice: str, parallel: bool,
             response: dict[str, Any] | bool | None) -> GrammarSpec | None:
    """`response`: the schema of an answer that is no call (None: free text)."""
    if fmt == "harmony":
        return None if choice == "auto" else _harmony_grammar(tools)
    args_key = "parameters" if fmt == "llama3" else "arguments"
    defs: dict[str, Any] = {}
    calls = [_call_schema(t, args_key, defs) for t in tools]
    if fmt == "generic":
        envelope = _generic_envelope(calls, parallel)
        if choice == "auto":
            answer = {"type": "string"} if response is None else _rebased(response, "#/$defs/response")
            if response is not None and '"$ref": "#' in json.dumps(response):
                defs["response"], answer = answer, {"$ref": "#/$defs/response"}
            envelope = {"anyOf": [envelope, {"type": "object", "properties": {"response": answer},
                                             "required": ["response"], "additionalProperties": False}]}
        return GrammarSpec.json_schema(_with_defs(envelope, defs), "tools")
    body = f"body: {_lark_json(_with_defs(_one_of(calls), defs))}"
    if fmt == "llama3":  # one call per turn
        if choice == "auto":  # text that does not start with "{", or the call
            return GrammarSpec("lark", f"start: TEXT | body\nTEXT: /[^{{](.|\\n)*/\n{body}", "tools")
        return GrammarSpec("lark", f"start: body\n{body}", "tools")
    call = f'"\\n" body "\\n{HERMES_END}"'
    more = f'("\\n{HERMES_START}" {call})*' if parallel else ""
    if choice == "auto" and response is not None:  # the JSON answer, or calls from the first character
        return GrammarSpec("lark", f'start: answer | "{HERMES_START}" {call} {more}\n'
                                   f"answer: {_lark_json(response if isinstance(response, dict) else {})}\n{body}",
                           "response_format")
    if choice == "auto":
        rules = (f"start: free | head {call} {more}\n"
                 f'head[lazy]: FREE "{HERMES_START}"\n'
                 "free: FREE\n"
                 f"FREE: /(.|\\n)*/ & ~/(?s:.*){HERMES_START}(?s:.*)/\n")
    else:
        rules = f'start: "{HERMES_START}" {call} {more}\n'
    return GrammarSpec("lark", rules + body, "tools")


def plan_tools(tools: list[ToolDefinition] | None, tool_choice: str | NamedToolChoice | None,
               parallel_tool_calls: bool | None, template: str,
               response: dict[str, Any] | bool | None = None) -> ToolPlan | None:
    """The plan for a request's tools (None without any); `response`: the JSON schema of the response_format, which
    an answer that is no call follows. StructuredOutputError for definitions or a choice that cannot be honoured."""
    fmt = tool_format(template)
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise StructuredOutputError("tool_choice requires tools", "tool_choice")
        return None
    _check_tools(tools)
    choice = tool_choice if tool_choice is not None else "auto"
    chosen = tools
    if isinstance(choice, NamedToolChoice):
        chosen = [t for t in tools if t.function.name == choice.function.name]
        if not chosen:
            raise StructuredOutputError(f"tool_choice names the function {choice.function.name!r}, which is not "
                                        "in tools", "tool_choice")
        choice = "named"
    parallel = parallel_tool_calls is not False and choice != "named" and fmt not in ("llama3", "harmony")
    if choice == "none":
        return ToolPlan(fmt, [], "none", parallel, None)
    if choice != "auto":
        response = None  # the output is calls
    if response is not None and fmt == "llama3":
        raise StructuredOutputError("this model's tool-call format (a JSON object) cannot tell a JSON answer from a "
                                    "call: send tool_choice 'none' or 'required', or no response_format",
                                    "response_format")
    definitions = [t.model_dump(exclude_none=True) for t in chosen]
    return ToolPlan(fmt, definitions, choice, parallel, _grammar(fmt, chosen, choice, parallel, response),
                    json_response=response is not None and fmt != "harmony")


def _arguments(call: Any, where: str) -> Any:
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError as e:
        raise StructuredOutputError(f"tool call arguments must be JSON: {e}", f"{where}.function.arguments") from None


def _generic_prompt(plan: ToolPlan) -> str:
    listed = "\n".join(json.dumps({"name": t["function"]["name"], "description": t["function"].get("description", ""),
                                   "arguments": t["function"].get("parameters") or NO_PARAMETERS},
                                  ensure_ascii=False) for t in plan.tools)
    call = {"name": plan.tools[0]["function"]["name"], "arguments": {}}
    example = {"tool_calls": [call]} if plan.parallel else {"tool_call": call}
    return GENERIC_TOOL_PROMPT.format(tools=listed, call_key="tool_calls" if plan.parallel else "tool_call",
                                      example=json.dumps(example))


def _harmony_turns(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """gpt-oss's template writes one call per assistant message and names a tool result by the call just before
    it: an assistant message with several calls becomes one message per call (its text and thinking with the
    first), and each result given by id follows its own call."""
    out: list[dict[str, Any]] = []
    results = {m["tool_call_id"]: m for m in conversation if m["role"] == "tool" and "tool_call_id" in m}
    placed: set[int] = set()
    for m in conversation:
        if m["role"] == "tool" and id(m) in placed:
            continue
        calls = m.get("tool_calls") or []
        if m["role"] != "assistant" or len(calls) < 2:
            out.append(m)
            continue
        for i, call in enumerate(calls):
            turn = {k: v for k, v in m.items() if k != "tool_calls"} if i == 0 else {"role": "assistant"}
            out.append({"content": "", **turn, "tool_calls": [call]})
            result = results.get(call["id"])
            if result is not None and id(result) not in placed:
                out.append(result)
                placed.add(id(result))
    return out


def template_messages(messages: list[ChatMessage], fmt: ToolFormatName,
                      plan: ToolPlan | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The conversation as the chat template gets it, and the template variables (`tools`).

    Templates with tool support get assistant `tool_calls` (arguments as objects, as transformers passes them)
    and `tool` messages with their `tool_call_id`; for "generic" templates calls become the JSON the model is asked
    to write and results user turns `{"tool_response": {...}}`, and the tools go in a system prompt."""
    names = {c.id: c.function.name for m in messages for c in (m.tool_calls or [])}
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        entry: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            entry["name"] = m.name
        thinking = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if m.role == "assistant" and thinking is not None:
            entry["reasoning_content"] = thinking  # the name templates read (Qwen3's, DeepSeek's)
            if fmt == "harmony":
                entry["thinking"] = thinking  # gpt-oss's
                if m.tool_calls:  # its template takes a call's text or its thinking, not both: the thinking
                    entry["content"] = ""
        calls = [(c, _arguments(c, f"messages.{i}.tool_calls.{j}")) for j, c in enumerate(m.tool_calls or [])]
        if fmt == "generic":
            if calls:
                listed = [{"name": c.function.name, "arguments": a} for c, a in calls]
                envelope = {"tool_calls": listed} if len(listed) > 1 else {"tool_call": listed[0]}
                entry["content"] = json.dumps(envelope, ensure_ascii=False)
            if m.role == "tool":
                result = {"tool_call_id": m.tool_call_id, "name": names.get(m.tool_call_id or ""),
                          "content": m.text()}
                entry = {"role": "user", "content": json.dumps({"tool_response": result}, ensure_ascii=False)}
        else:
            if calls:
                entry["tool_calls"] = [{"id": c.id, "type": "function",
                                        "function": {"name": c.function.name, "arguments": a}} for c, a in calls]
            if m.tool_call_id is not None:
                entry["tool_call_id"] = m.tool_call_id
        out.append(entry)
    if fmt == "harmony":
        out = _harmony_turns(out)
    variables: dict[str, Any] = {}
    if plan is not None and plan.tools:
        if fmt == "harmony":  # the template writes each description as a comment, and fails on a missing one
            variables["tools"] = [{**t, "function": {"description": "", **t["function"]}} for t in plan.tools]
        elif fmt == "generic":
            prompt = _generic_prompt(plan)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
            else:
                out.insert(0, {"role": "system", "content": prompt})
        else:
            variables["tools"] = plan.tools
    return out, variables
