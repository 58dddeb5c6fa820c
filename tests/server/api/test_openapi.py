"""The OpenAPI document itself (built in-process, no model needed): the statuses and media types each route
declares, as the server answers them. That the real answers match it is tests/e2e/test_openapi_fuzz.py's part."""
from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from server.api.app import create_app
from server.errors import APIError
from server.config.settings import Settings

ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
ANTHROPIC_ERROR_REF = {"$ref": "#/components/schemas/AnthropicErrorResponse"}
PROBES = {"/health", "/livez", "/metrics"}


def document(**settings: Any) -> dict[str, Any]:
    return create_app(Settings(**settings)).openapi()


def operations(doc: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(method.upper(), path, op) for path, item in doc["paths"].items() for method, op in item.items()]


def test_no_route_declares_fastapis_422() -> None:
    doc = document()
    for method, path, op in operations(doc):
        assert "422" not in op["responses"], (method, path)
    assert not {"HTTPValidationError", "ValidationError"} & set(doc["components"]["schemas"])


# Every status each route may answer besides 401 (only with a key) and 500 (any route, on a bug).
STATUSES = {
    ("GET", "/livez"): {"200"},
    ("GET", "/health"): {"200", "503"},
    ("GET", "/metrics"): {"200"},
    ("GET", "/version"): {"200"},
    ("GET", "/v1/models"): {"200", "503"},
    ("GET", "/v1/presets"): {"200"},
    ("GET", "/v1/models/{model_id}"): {"200", "404", "503"},
    ("POST", "/v1/chat/completions"): {"200", "400", "404", "413", "429", "503"},
    ("POST", "/v1/completions"): {"200", "400", "404", "413", "429", "503"},
    ("POST", "/v1/responses"): {"200", "400", "404", "413", "429", "503"},
    ("GET", "/v1/responses/{response_id}"): {"200", "404", "503"},
    ("DELETE", "/v1/responses/{response_id}"): {"200", "404", "503"},
    ("GET", "/v1/responses/{response_id}/input_items"): {"200", "400", "404", "503"},
    ("POST", "/v1/messages"): {"200", "400", "404", "413", "429", "503"},
    ("POST", "/v1/messages/count_tokens"): {"200", "400", "404", "413", "503"},
    ("POST", "/tokenize"): {"200", "400", "404", "413", "503"},
    ("POST", "/detokenize"): {"200", "400", "404", "413", "503"},
    ("POST", "/v1/embeddings"): {"200", "400", "404", "413", "429", "503"},
}


def test_each_route_declares_the_statuses_it_answers() -> None:
    declared = {(method, path): set(op["responses"]) - {"500"} for method, path, op in operations(document())}
    assert declared == STATUSES


def test_every_error_status_is_the_envelope_of_its_api_and_retry_after_is_declared() -> None:
    for method, path, op in operations(document(api_key="k")):
        envelope = ANTHROPIC_ERROR_REF if path.startswith("/v1/messages") else ERROR_REF
        for status, response in op["responses"].items():
            if int(status) < 400 or (path == "/health" and status == "503"):
                continue
            assert response["content"] == {"application/json": {"schema": envelope}}, (method, path, status)
            if status in ("429", "503"):
                assert "Retry-After" in response["headers"], (method, path, status)


def test_the_envelope_schemas_are_what_errors_answer() -> None:
    doc = document()
    schema = {"$ref": "#/components/schemas/ErrorResponse", "components": doc["components"]}
    anthropic = {**ANTHROPIC_ERROR_REF, "components": doc["components"]}
    for error in (APIError(404, "no such model", param="model", code="model_not_found"), APIError(500, "boom")):
        jsonschema.validate(error.body(), schema)
        jsonschema.validate(error.anthropic_body(), anthropic)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(APIError(400, "m").body(), anthropic)
    for wrong in ({"error": {"message": "m", "type": "t", "param": None, "code": 5}},       # an integer code
                  {"error": {"message": "m", "type": "t", "param": None}},                 # a key missing
                  {"error": {"message": "m", "type": "t", "param": None, "code": None, "x": 1}},
                  {"message": "m", "type": "t", "param": None, "code": None}):             # flat
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


def test_401_is_declared_exactly_when_a_key_is_set() -> None:
    for method, path, op in operations(document()):
        assert "401" not in op["responses"] and "security" not in op, (method, path)
    doc = document(api_key="k")
    assert doc["components"]["securitySchemes"] == {
        "bearer": {"type": "http", "scheme": "bearer"},
        "api_key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    for method, path, op in operations(doc):
        assert ("401" in op["responses"]) == (path not in PROBES), (method, path)
        assert op.get("security") == (None if path in PROBES else [{"bearer": []}, {"api_key": []}]), (method, path)


def test_media_types_metrics_text_and_event_streams() -> None:
    doc = document()
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain; version=0.0.4"]
    for path, chunk in (("/v1/chat/completions", "ChatCompletionChunk"), ("/v1/completions", "CompletionChunk")):
        content = doc["paths"][path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}
        event = content["text/event-stream"]["schema"]
        data = event["properties"]["data"]["anyOf"]
        assert {"const": "[DONE]"} in data
        assert {"$ref": f"#/components/schemas/{chunk}"} in data[1]["contentSchema"]["anyOf"]
        assert ERROR_REF in data[1]["contentSchema"]["anyOf"]
        assert chunk in doc["components"]["schemas"]
    # The Responses and Anthropic streams: named events, each data one of the route's event models, no [DONE].
    for path, events in (("/v1/responses", {"ResponseLifecycleEvent", "OutputTextDeltaEvent", "ResponseErrorEvent"}),
                         ("/v1/messages", {"MessageStartEvent", "ContentBlockDeltaEvent", "AnthropicErrorResponse"})):
        content = doc["paths"][path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}
        event = content["text/event-stream"]["schema"]
        assert event["required"] == ["data", "event"]
        refs = {ref["$ref"].rsplit("/", 1)[1] for ref in event["properties"]["data"]["contentSchema"]["anyOf"]}
        assert events <= refs <= set(doc["components"]["schemas"]), refs
    for path in ("/tokenize", "/detokenize", "/v1/models", "/v1/messages/count_tokens"):
        method = "get" if path == "/v1/models" else "post"
        assert list(doc["paths"][path][method]["responses"]["200"]["content"]) == ["application/json"]


def test_health_declares_its_ready_and_unavailable_bodies() -> None:
    doc = document()
    responses = doc["paths"]["/health"]["get"]["responses"]
    schemas = doc["components"]["schemas"]
    assert responses["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Health"}
    assert responses["503"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/HealthUnavailable"}
    assert schemas["HealthUnavailable"]["properties"]["status"]["enum"] == ["loading", "draining", "unhealthy"]
    assert {"status", "model", "running", "queued", "kv_blocks_total"} <= set(schemas["Health"]["required"])


def test_a_multi_model_server_also_documents_its_operator_routes() -> None:
    declared = {(method, path): set(op["responses"]) - {"500"}
                for method, path, op in operations(document(models=["gemma3-270m"]))}
    assert declared == {**STATUSES, ("POST", "/models/load"): {"200", "404", "503"},
                        ("POST", "/models/unload"): {"200", "404", "409"}}
