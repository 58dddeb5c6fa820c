"""GET /openapi.json as the server really answers: each route's error statuses with its API's envelope (OpenAI's,
Anthropic's under /v1/messages), event streams for `stream: true`, Prometheus text for /metrics, 401 when an API
key is set, and none of FastAPI's 422s (validation errors answer 400)."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from pydantic import BaseModel

from server.errors import speaks_anthropic
from server.api.openai.protocol import ChatCompletionChunk, CompletionChunk, ErrorResponse
from server.api.anthropic.protocol import MESSAGE_STREAM_EVENTS, AnthropicErrorResponse
from server.api.responses.protocol import RESPONSE_STREAM_EVENTS
from server.api.request_context import OPEN_PATHS

PROMETHEUS_TEXT = "text/plain; version=0.0.4"
RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}
# What each error status means on this server; every one answers the envelope (components/schemas/ErrorResponse).
ERRORS = {
    400: "Invalid request: malformed or non-UTF-8 JSON, a field out of range, a prompt too long for the context "
         "(`context_length_exceeded`) or over --max-prompt-tokens (`prompt_too_long`), too many prompts "
         "(`too_many_prompts`) or embedding inputs (`too_many_inputs`), a route the served model does not serve "
         "(`embeddings_only`, `embeddings_not_enabled`).",
    401: "Missing or wrong key, given as `Authorization: Bearer` or `x-api-key` (`invalid_api_key`).",
    404: "The model is not the served one (`model_not_found`), or no stored response has that id "
         "(`response_not_found`, `previous_response_not_found`).",
    409: "The model is in use (`model_busy`) or loading (`model_loading`): a multi-model server unloads it "
         "once its requests have finished.",
    413: "The request body is over --max-request-bytes (`request_too_large`).",
    429: "The worker's queue is full (`queue_full`): retry after Retry-After seconds.",
    500: "An unexpected failure (logged with its traceback on the server).",
    503: "The model is still loading (`model_loading`, with Retry-After; on a multi-model server past "
         "--load-timeout), there is no room to load it beside the models in use (`no_room_for_model`, with "
         "Retry-After) or it is over the memory budget (`model_too_large`), or the server is shutting down "
         "(`shutting_down`).",
}
_SCHEMAS = "#/components/schemas/"
_ERROR_REF = {"$ref": f"{_SCHEMAS}{ErrorResponse.__name__}"}
_ANTHROPIC_ERROR_REF = {"$ref": f"{_SCHEMAS}{AnthropicErrorResponse.__name__}"}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"{_SCHEMAS}{model.__name__}"}


def _chunk_events(chunk: type[BaseModel]) -> dict[str, Any]:
    """One SSE event of the chat and completions streams: `data:` a chunk, a mid-stream error in the envelope, or
    the final [DONE]."""
    payload = {"anyOf": [_ref(chunk), _ERROR_REF]}
    return {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
        {"const": "[DONE]"},
        {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}]}}}


def _named_events(models: list[type[BaseModel]]) -> dict[str, Any]:
    """One SSE event of the Responses and Anthropic streams: an `event:` name and its `data:` object, whose
    `type` is that name (a failure mid-stream is an `error` event); no [DONE]."""
    payload = {"anyOf": [_ref(m) for m in models]}
    return {"type": "object", "required": ["data", "event"], "properties": {
        "event": {"type": "string"},
        "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}}}


# The events each streaming route sends, by path (and the models they use); OpenAPI 3.1 has a text/event-stream
# `schema` describe one event.
STREAMS = {"/v1/chat/completions": (_chunk_events(ChatCompletionChunk), [ChatCompletionChunk]),
           "/v1/completions": (_chunk_events(CompletionChunk), [CompletionChunk]),
           "/v1/responses": (_named_events(RESPONSE_STREAM_EVENTS), RESPONSE_STREAM_EVENTS),
           "/v1/messages": (_named_events(MESSAGE_STREAM_EVENTS), MESSAGE_STREAM_EVENTS)}
SECURITY_SCHEMES = {"bearer": {"type": "http", "scheme": "bearer"},
                    "api_key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}


def errors(*statuses: int, envelope: type[BaseModel] = ErrorResponse) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route that answers these error statuses."""
    return {status: {"model": envelope, "description": ERRORS[status],
                     **({"headers": RETRY_AFTER} if status in (429, 503) else {})} for status in statuses}


def anthropic_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route of Anthropic's API that answers these error statuses."""
    return errors(*statuses, envelope=AnthropicErrorResponse)


def _add_models(document: dict[str, Any], models: list[type]) -> None:
    """The models' JSON schemas (and the ones they use) as components, next to those FastAPI put there."""
    _, defs = models_json_schema([(m, "serialization") for m in models], ref_template=_SCHEMAS + "{model}")
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for name, schema in defs.get("$defs", {}).items():
        schemas.setdefault(name, schema)


def _finish(document: dict[str, Any], api_key: bool) -> None:
    _add_models(document, [ErrorResponse, AnthropicErrorResponse, *(m for _, ms in STREAMS.values() for m in ms)])
    for path, item in document["paths"].items():
        error = {"schema": _ANTHROPIC_ERROR_REF if speaks_anthropic(path) else _ERROR_REF}
        for operation in item.values():
            responses = operation["responses"]
            responses.pop("422", None)
            responses["500"] = {"description": ERRORS[500], "content": {"application/json": error}}
            if api_key and path not in OPEN_PATHS:
                responses["401"] = {"description": ERRORS[401], "content": {"application/json": error},
                                    "headers": {"WWW-Authenticate": {"schema": {"type": "string"}}}}
                operation["security"] = [{name: []} for name in SECURITY_SCHEMES]  # either one
            if path in STREAMS and "200" in responses:
                responses["200"]["content"]["text/event-stream"] = {"schema": STREAMS[path][0]}
            operation["responses"] = dict(sorted(responses.items()))
    schemas = document["components"]["schemas"]
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    if api_key:
        document["components"]["securitySchemes"] = SECURITY_SCHEMES


def install_openapi(app: FastAPI, api_key: bool) -> None:
    """Make `app.openapi()` (and so GET /openapi.json and /docs) build the document described above, once."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, description=app.description,
                                   routes=app.routes)
            _finish(document, api_key)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
