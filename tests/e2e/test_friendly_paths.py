"""The paths a new user's first requests take: the OpenAI routes without their /v1 prefix (a base URL of the
server's root), a trailing slash, and GET /version; against the suite's real server, with the official client."""
from __future__ import annotations

import httpx
import openai

from server import __version__


def test_a_client_whose_base_url_lacks_v1_is_served(base_url: str, client: openai.OpenAI) -> None:
    """`OpenAI(base_url="http://host:port")` posts to /chat/completions: the same answer as under /v1."""
    root = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    ask = {"model": client.models.list().data[0].id, "messages": [{"role": "user", "content": "Say hi."}],
           "max_tokens": 8, "temperature": 0}
    assert root.chat.completions.create(**ask).choices[0].message.content == \
        client.chat.completions.create(**ask).choices[0].message.content
    assert [m.id for m in root.models.list().data] == [m.id for m in client.models.list().data]
    completion = root.completions.create(model=ask["model"], prompt="The capital of France is", max_tokens=4,
                                         temperature=0)
    assert completion.choices[0].text == client.completions.create(
        model=ask["model"], prompt="The capital of France is", max_tokens=4, temperature=0).choices[0].text


def test_a_trailing_slash_is_the_same_route(http: httpx.Client) -> None:
    """No 307 with an empty body: the route answers as without the slash, streaming included."""
    model = http.get("/v1/models/").json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}
    slash, plain = http.post("/v1/chat/completions/", json=body), http.post("/v1/chat/completions", json=body)
    assert slash.status_code == 200, slash.text
    assert slash.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    with http.stream("POST", "/chat/completions/", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert "data: [DONE]" in r.read().decode()


def test_unknown_paths_are_still_404_envelopes(http: httpx.Client) -> None:
    for path in ("/chat", "/v2/chat/completions", "/nothing/"):
        r = http.post(path, json={})
        assert r.status_code == 404 and "not found" in r.json()["error"]["message"], (path, r.text)


def test_version(http: httpx.Client) -> None:
    r = http.get("/version")
    assert r.status_code == 200 and r.json() == {"version": __version__}
