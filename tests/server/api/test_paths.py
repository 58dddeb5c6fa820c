"""PathAliases: which request paths are answered on which route (the e2e tests run them through a real server)."""
from __future__ import annotations

import pytest

from server.api.paths import PathAliases
from server.api.routes import router


@pytest.fixture(scope="module")
def aliases() -> PathAliases:
    return PathAliases(app=None, v1_paths=[route.path for route in router.routes])  # type: ignore[arg-type]


@pytest.mark.parametrize("path, canonical", [
    ("/chat/completions", "/v1/chat/completions"), ("/completions", "/v1/completions"), ("/models", "/v1/models"),
    ("/models/smollm2-135m", "/v1/models/smollm2-135m"), ("/embeddings", "/v1/embeddings"),
    ("/responses/resp_1/input_items", "/v1/responses/resp_1/input_items"), ("/messages", "/v1/messages"),
    ("/v1/chat/completions/", "/v1/chat/completions"), ("/chat/completions/", "/v1/chat/completions"),
    ("/health/", "/health"), ("/", "/"), ("/v1/chat/completions", "/v1/chat/completions"),
    ("/tokenize", "/tokenize"), ("/metrics", "/metrics"), ("/nothing", "/nothing"), ("/v2/models", "/v2/models"),
])
def test_canonical_paths(aliases: PathAliases, path: str, canonical: str) -> None:
    assert aliases.canonical(path) == canonical
