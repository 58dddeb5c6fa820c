"""`HttpChat`: the chat's answers from a running server (emberserve, or any OpenAI-compatible one), streamed from
POST /v1/chat/completions over httpx."""
from __future__ import annotations

import json
import os
from collections.abc import Generator
from typing import Any

import httpx

from server.launch.chat_session import ChatError

CONNECT_TIMEOUT_S = 10.0
# The API key's variables, in the order they are read when --api-key is not given.
API_KEY_VARIABLES = ("EMBERSERVE_API_KEY", "OPENAI_API_KEY")


def api_root(url: str) -> str:
    """The server's root from a URL with or without /v1 (and a scheme: http:// if none)."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    return url.removesuffix("/v1").rstrip("/")


def api_key_from_environment() -> str | None:
    return next((os.environ[name] for name in API_KEY_VARIABLES if os.environ.get(name)), None)


def _error_message(response: httpx.Response) -> str:
    """An error answer's message: the envelope's, else the status and the start of the body."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict) and error.get("message"):
        return f"{error['message']} ({response.status_code})"
    return f"{response.status_code} {response.reason_phrase}: {response.text[:200]}"


class HttpChat:
    """A server's chat completions; `model` is the one named, else the first the server lists."""

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None) -> None:
        self.root = api_root(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # No read timeout: a long prompt's prefill may take a while before the first token.
        self._http = httpx.Client(base_url=self.root, headers=headers,
                                  timeout=httpx.Timeout(CONNECT_TIMEOUT_S, read=None))
        try:
            self.model = model or self._first_model()
        except BaseException:
            self._http.close()
            raise

    def _first_model(self) -> str:
        try:
            response = self._http.get("/v1/models")
        except httpx.HTTPError as e:
            raise ChatError(f"cannot reach {self.root}: {e}") from None
        if response.status_code != 200:
            raise ChatError(f"{self.root}/v1/models: {_error_message(response)}")
        models = [m.get("id") for m in response.json().get("data", []) if m.get("id")]
        if not models:
            raise ChatError(f"{self.root} serves no model")
        return str(models[0])

    def stream(self, messages: list[dict[str, str]], options: dict[str, Any]) -> Generator[str, None, None]:
        """The answer's text in pieces; leaving early (closing the iterator, Ctrl-C) closes the connection, which
        cancels the generation on the server."""
        body = {"model": self.model, "messages": messages, **options, "stream": True}
        try:
            with self._http.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise ChatError(_error_message(response))
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line.removeprefix("data:").strip()
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if event.get("error"):  # a failure after the stream began
                        raise ChatError(str(event["error"].get("message", event["error"])))
                    for choice in event.get("choices") or []:
                        piece = (choice.get("delta") or {}).get("content")
                        if piece:
                            yield piece
        except httpx.HTTPError as e:
            raise ChatError(f"{self.root}: {e}") from None
        except json.JSONDecodeError as e:
            raise ChatError(f"{self.root} sent an event that is not JSON: {e}") from None

    def close(self) -> None:
        self._http.close()
