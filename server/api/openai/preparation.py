"""What a validated generation request holds its output to, its prompt ids from a chat, and the rules that follow
from the request's type; `OpenAIServing.prepare` (server/api/openai/serving.py) turns a request into its submitted
Generations with them, the one way for every endpoint that generates: chat completions, completions, the chat-mapped
Responses and Messages APIs and the in-process `Generator`.
"""
from __future__ import annotations

import json
from typing import Any
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from jinja2 import TemplateError

from server.api.openai.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, StructuredRequest
from server.api.openai.structured_outputs import output_grammar
from server.api.openai.tool_calls import ToolPlan, plan_tools, template_messages, tool_format
from server.errors import invalid
from server.reasoning.plan import HARMONY_EFFORTS
from server.grammar.spec import GrammarSpec, StructuredOutputError
from server.scheduling.generation import Generation
from server.scheduling.model_state import ModelState


def chat_prompt_ids(state: ModelState, messages: list[ChatMessage], add_generation_prompt: bool,
                    tools: ToolPlan | None = None, template_kwargs: dict[str, Any] | None = None,
                    reasoning_effort: str | None = None) -> list[int]:
    """The prompt ids of a chat: the model's chat template over `messages` (and the tools, in the template's call
    format), whose text stays text unless the server trusts its callers (`parse_special_in_messages`); a template
    that rejects the messages is a 400. The template also gets the server's `--chat-template-kwargs`, over them the
    request's `reasoning_effort` (a harmony template's "Reasoning: low | medium | high", the nearest of them), over
    that the request's `template_kwargs` (`enable_thinking`, say); the tools stay the server's."""
    tokenizer = state.model.tokenizer
    try:
        fmt = tool_format(tokenizer.chat_template)
        conversation, variables = template_messages(messages, fmt, tools)
        effort = {} if reasoning_effort is None else {
            "reasoning_effort": HARMONY_EFFORTS[reasoning_effort] if fmt == "harmony" else reasoning_effort}
        variables = {**state.chat_template_kwargs, **effort, **(template_kwargs or {}), **variables}
        return tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                             parse_special_in_messages=state.parse_special_in_messages, **variables)
    except StructuredOutputError as e:
        raise invalid(e.message, param=e.param) from None
    except (TemplateError, ValueError, TypeError) as e:
        raise invalid(f"the model's chat template rejected the messages: {e}", param="messages") from None


@dataclass(frozen=True)
class OutputPlan:
    """What a request holds its output to: the grammar (the response format's, or the tool calls' with the
    response format's answer in it) and the tool plan (None without tools: always for completions)."""

    grammar: GrammarSpec | None
    tools: ToolPlan | None

    @property
    def calls(self) -> ToolPlan | None:
        """The tool plan when the output is parsed for calls (not with tool_choice "none")."""
        return self.tools if self.tools is not None and self.tools.parses_calls else None


def plan_output(req: StructuredRequest, template: str) -> OutputPlan:
    """The output plan of a request (`template`: the model's chat template, which says a chat's call format); a 400
    naming the field when its format or tools cannot be honoured. Every generating endpoint plans here."""
    try:
        spec = output_grammar(req.response_format, req.structured_outputs)
        if not isinstance(req, ChatCompletionRequest):
            return OutputPlan(spec, None)
        response = None
        if spec is not None and req.tools and req.tool_choice != "none":
            if spec.kind != "json_schema":
                raise StructuredOutputError("with tools, only a JSON response_format can shape the answer",
                                            spec.param)
            response = json.loads(spec.source)
        tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, template, response)
    except StructuredOutputError as e:
        raise invalid(e.message, param=e.param) from None
    if tools is not None and tools.grammar is not None:
        spec = tools.grammar  # the calls' grammar, with the response_format's answer in it
    return OutputPlan(spec, tools)


def budget_fields(req: StructuredRequest) -> tuple[str, ...]:
    """The fields a request's completion budget comes from, the first set winning (`completion_budget`): a chat's
    max_completion_tokens, then its max_tokens (whatever endpoint the chat came through); a completion's
    max_tokens."""
    if isinstance(req, ChatCompletionRequest):
        return "max_completion_tokens", "max_tokens"
    return ("max_tokens",)


def requested_logprobs(req: StructuredRequest) -> tuple[bool, int]:
    """(logprobs, top_logprobs) as the request asks for them."""
    if isinstance(req, ChatCompletionRequest):
        return req.logprobs, req.top_logprobs or 0
    assert isinstance(req, CompletionRequest)
    return req.logprobs is not None, req.logprobs or 0


def prompt_logprobs(req: StructuredRequest) -> int | None:
    """The prompt logprobs a request asks for: a completion that echoes its prompt with logprobs."""
    if isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None:
        return req.logprobs
    return None


# The endpoint's own step of the preparation: the prompt ids of each of the request's prompts (a chat template over
# the messages, given the plan's tools; text; token ids), in order.
PromptIds = Callable[[OutputPlan], Awaitable[list[list[int]]]]


@dataclass(frozen=True)
class Prepared:
    """A request's Generations, one per prompt and submitted to the worker pool, and its output plan."""

    gens: list[Generation]
    plan: OutputPlan
