"""GET /openapi.json as the server really answers: each route's error statuses with the OpenAI envelope, event
streams for `stream: true`, Prometheus text for /metrics, 401 when an API key is set, and none of FastAPI's 422s
(validation errors answer 400)."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from .protocol import ChatCompletionChunk, CompletionChunk, ErrorResponse
from .request_context import OPEN_PATHS

PROMETHEUS_TEXT = "text/plain; version=0.0.4"
RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}
# What each error status means on this server; every one answers the envelope (components/schemas/ErrorResponse).
ERRORS = {
    400: "Invalid request: malformed or non-UTF-8 JSON, a field out of range, a prompt too long for the context "
         "(`context_length_exceeded`) or over --max-prompt-tokens (`prompt_too_long`), too many prompts "
         "(`too_many_prompts`) or embedding inputs (`too_many_inputs`), a route the served model does not serve "
         "(`embeddings_only`, `embeddings_not_enabled`).",
    401: "Missing or wrong `Authorization: Bearer` key (`invalid_api_key`).",
    404: "The model is not the served one (`model_not_found`).",
    413: "The request body is over --max-request-bytes (`request_too_large`).",
    429: "The worker's queue is full (`queue_full`): retry after Retry-After seconds.",
    500: "An unexpected failure (logged with its traceback on the server).",
    503: "The model is still loading (`model_loading`, with Retry-After) or the server is shutting down "
         "(`shutting_down`).",
}
_SCHEMAS = "#/components/schemas/"
_ERROR_REF = {"$ref": f"{_SCHEMAS}{ErrorResponse.__name__}"}
# The chunks each streaming route sends, by path; OpenAPI 3.1 has a text/event-stream `schema` describe one event.
STREAMS = {"/v1/chat/completions": ChatCompletionChunk, "/v1/completions": CompletionChunk}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route that answers these error statuses."""
    return {status: {"model": ErrorResponse, "description": ERRORS[status],
                     **({"headers": RETRY_AFTER} if status in (429, 503) else {})} for status in statuses}


def _event_schema(chunk: type) -> dict[str, Any]:
    """One SSE event: `data:` a chunk, a mid-stream error in the envelope, or the final [DONE]."""
    payload = {"anyOf": [{"$ref": f"{_SCHEMAS}{chunk.__name__}"}, _ERROR_REF]}
    return {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
        {"const": "[DONE]"},
        {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}]}}}


def _add_models(document: dict[str, Any], models: list[type]) -> None:
    """The models' JSON schemas (and the ones they use) as components, next to those FastAPI put there."""
    _, defs = models_json_schema([(m, "serialization") for m in models], ref_template=_SCHEMAS + "{model}")
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for name, schema in defs.get("$defs", {}).items():
        schemas.setdefault(name, schema)


def _finish(document: dict[str, Any], api_key: bool) -> None:
    _add_models(document, [ErrorResponse, *STREAMS.values()])
    for path, item in document["paths"].items():
        for operation in item.values():
            responses = operation["responses"]
            responses.pop("422", None)
            responses["500"] = {"description": ERRORS[500], "content": {"application/json": {"schema": _ERROR_REF}}}
            if api_key and path not in OPEN_PATHS:
                responses["401"] = {"description": ERRORS[401], "content": {"application/json": {"schema": _ERROR_REF}},
                                    "headers": {"WWW-Authenticate": {"schema": {"type": "string"}}}}
                operation["security"] = [{"bearer": []}]
            if path in STREAMS:
                responses["200"]["content"]["text/event-stream"] = {"schema": _event_schema(STREAMS[path])}
            operation["responses"] = dict(sorted(responses.items()))
    schemas = document["components"]["schemas"]
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    if api_key:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}


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
