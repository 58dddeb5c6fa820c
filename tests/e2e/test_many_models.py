"""Many models in one server (server/api/model_router.py, server/process/model_manager.py), through real server
processes and the official openai client: SmolLM2 as the default model beside tiny random models (safetensors
directories from tests/support/tiny_models.py, named with --model and an alias, or found under --models-dir).

/v1/models lists every model with its state; three models answer at once; a model loads on demand while another
streams, whose inter-token latency stays within noise; an unknown model is a 404 listing the servable ones;
/metrics has each model's state and labelled figures; unloading gives the process tree's memory back; with
--max-loaded-models 1 the least recently used idle model is unloaded, never one under a live stream (a request
that finds no room waits --load-timeout, then 503 with Retry-After); --idle-unload unloads a model nobody uses;
past the memory budget an idle model is unloaded first, and a model too big for it is refused;
an engine process that dies unloads its model, loaded again by the next request; SIGTERM with several models
loaded exits 0 and leaves no process behind.

The tests of the `many` server run in file order: they load and unload its models in turn.
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from tests.e2e.test_engine_process import wait_gone
from tests.e2e.test_metrics import parse, value
from tests.support.processes import descendants, tree_rss
from tests.support.server_process import ServerProcess, start_server, stop_server, wait_ready
from tests.support.tiny_models import build_tiny_model

DEFAULT = "smollm2-135m"
ALIASED = "tiny-llama"            # --model DIR with --served-model-name DIR=tiny-llama
FOUND = ["tiny-gemma3", "tiny-qwen3"]  # under --models-dir, by their directories' names
BROKEN = "broken-model"  # under --models-dir too: a config.json and nothing else
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny models' safetensors directories, by the id each is served as (the --models-dir ones linked there
    under their ids)."""
    root = tmp_path_factory.mktemp("tiny-models")
    found = root / "models"
    found.mkdir()
    dirs = {ALIASED: build_tiny_model("llama_tied", root).safetensors_dir}
    (found / BROKEN).mkdir()
    (found / BROKEN / "config.json").write_text("{}")
    for name, variant in zip(FOUND, ["gemma3", "qwen3"]):
        (found / name).symlink_to(build_tiny_model(variant, root).safetensors_dir, target_is_directory=True)
        dirs[name] = found / name
    return dirs


@pytest.fixture(scope="module")
def lru(tmp_path_factory: pytest.TempPathFactory, tiny: dict[str, Path]) -> Iterator[ServerProcess]:
    """One model loaded at a time, unloaded after idle seconds, requests waiting briefly for a load. Started
    without waiting (beside `many`'s start): its test waits for it, by when its default model is idle-unloaded."""
    srv = start_server(tmp_path_factory.mktemp("lru"), "--model", str(tiny[FOUND[1]]), "--model", DEFAULT,
                       "--max-loaded-models", "1", "--idle-unload", "2", "--load-timeout", "2", wait=False)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory, tiny: dict[str, Path],
         lru: ServerProcess) -> Iterator[ServerProcess]:
    llama = str(tiny[ALIASED])
    srv = start_server(tmp_path_factory.mktemp("many"), "--model", DEFAULT, "--model", llama,
                       "--served-model-name", f"{llama}={ALIASED}", "--models-dir", str(tiny[FOUND[0]].parent))
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def http(many: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=many.base_url, timeout=120) as c:
        yield c


def _client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def states(http: httpx.Client) -> dict[str, dict[str, Any]]:
    return {card["id"]: card for card in http.get("/v1/models").json()["data"]}


def model_states(http: httpx.Client) -> dict[str, float]:
    samples = parse(http.get("/metrics").text)
    return {dict(labels)["model"]: v for (name, labels), v in samples.items() if name == "emberserve:model_state"}


def engines(srv: ServerProcess) -> set[int]:
    """The server's engine processes (multiprocessing's resource tracker, a child too, aside)."""
    found = set()
    for pid in descendants(srv.process.pid):
        try:
            if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text():
                found.add(pid)
        except OSError:
            pass
    return found


# ---- the `many` server: four models, the default loaded at start ----

def test_every_servable_model_is_listed_with_its_state(many: ServerProcess, http: httpx.Client) -> None:
    assert [m.id for m in _client(many).models.list().data] == [DEFAULT, ALIASED, BROKEN, *FOUND]
    cards = states(http)
    assert cards[DEFAULT]["state"] == "loaded" and cards[DEFAULT]["details"]["family"] == "llama"
    tokenized = http.post("/tokenize", json={"model": DEFAULT, "prompt": "Hi"}).json()
    assert cards[DEFAULT]["max_model_len"] == tokenized["max_model_len"] > 0
    for name in (ALIASED, BROKEN, *FOUND):
        assert (cards[name]["state"], cards[name]["max_model_len"], cards[name]["details"]) == ("unloaded", None, None)
    assert http.get(f"/v1/models/{FOUND[0]}").json() == cards[FOUND[0]]
    health = http.get("/health").json()
    assert health["model"] == DEFAULT and health["models"] == {m: c["state"] for m, c in cards.items()}
    assert model_states(http) == {DEFAULT: 2, ALIASED: 0, BROKEN: 0, FOUND[0]: 0, FOUND[1]: 0}
    assert len(engines(many)) == 1


def test_an_unknown_model_is_a_404_listing_the_servable_ones(many: ServerProcess, http: httpx.Client) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        _client(many).chat.completions.create(model="gpt-4o", messages=HI, max_tokens=1)
    error = raised.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert all(f"`{name}`" in error["message"] for name in (DEFAULT, ALIASED, BROKEN, *FOUND)), error
    for path, body in [("/tokenize", {"model": "gpt-4o", "prompt": "Hi"}),
                       ("/models/load", {"model": "gpt-4o"})]:
        r = http.post(path, json=body)
        assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found"), r.text
    assert http.get("/v1/models/gpt-4o").status_code == 404
    r = http.post("/v1/messages", json={"model": "gpt-4o", "max_tokens": 1, "messages": HI})
    assert r.status_code == 404 and r.json()["type"] == "error", r.text  # Anthropic's envelope
    assert list(states(http)) == [DEFAULT, ALIASED, BROKEN, *FOUND]


def test_a_model_that_cannot_load_is_a_500_saying_why_and_stays_unloaded(many: ServerProcess,
                                                                         http: httpx.Client) -> None:
    with pytest.raises(openai.InternalServerError) as raised:
        _client(many).chat.completions.create(model=BROKEN, messages=HI, max_tokens=1)
    error = raised.value.body
    assert error["code"] == "model_load_failed" and f"the model `{BROKEN}` cannot load" in error["message"], error
    assert states(http)[BROKEN]["state"] == "unloaded" and http.get("/health").status_code == 200


def test_three_models_answer_at_once(many: ServerProcess, http: httpx.Client, tiny: dict[str, Path]) -> None:
    client = openai.AsyncOpenAI(base_url=f"{many.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    names = [DEFAULT, ALIASED, FOUND[1]]

    async def ask_all() -> list[Any]:
        return await asyncio.gather(*(client.chat.completions.create(model=name, messages=HI, max_tokens=8,
                                                                     temperature=0) for name in names))

    before = parse(http.get("/metrics").text)
    answers = asyncio.run(ask_all())
    for name, answer in zip(names, answers):
        assert answer.model == name and answer.usage.completion_tokens == 8, answer
    cards = states(http)
    assert [cards[name]["state"] for name in names] == ["loaded"] * 3 and cards[FOUND[0]]["state"] == "unloaded"
    # A loaded tiny model's context is its config's, and its tokenizer is its own (not the default model's).
    assert cards[FOUND[1]]["max_model_len"] == 512 and cards[FOUND[1]]["details"]["family"] == "qwen3"
    tokens = http.post("/tokenize", json={"model": FOUND[1], "prompt": "Hi there"}).json()["tokens"]
    assert tokens == Tokenizer.from_file(str(tiny[FOUND[1]] / "tokenizer.json")).encode("Hi there").ids
    after = parse(http.get("/metrics").text)
    for name in names:
        assert (value(after, "generation_tokens_total", model=name)
                - value(before, "generation_tokens_total", model=name)) == 8, name
        assert value(after, "request_success_total", model=name, finished_reason="length") >= 1, name
    assert model_states(http) == {DEFAULT: 2, ALIASED: 2, BROKEN: 0, FOUND[0]: 0, FOUND[1]: 2}
    assert len(engines(many)) == 3


def test_a_load_past_the_memory_budget_unloads_an_idle_model_else_is_refused(
        many: ServerProcess, tmp_path_factory: pytest.TempPathFactory, tiny: dict[str, Path]) -> None:
    """A budget that holds one tiny model's engine process but not two (sized from one of `many`'s): loading the
    second unloads the first (idle); SmolLM2, bigger than the budget alone, is refused with a 503 saying so."""
    pid = int(re.findall(rf"loaded {FOUND[1]} in [\d.]+s \(engine process (\d+),", many.log())[-1])
    budget = int(1.25 * tree_rss(pid)) >> 20
    srv = start_server(tmp_path_factory.mktemp("budget"), "--model", str(tiny[FOUND[1]]), "--model",
                       str(tiny[FOUND[0]]), "--model", DEFAULT, "--memory-budget", f"{budget}MiB")
    try:
        with httpx.Client(base_url=srv.base_url, timeout=120) as http:
            answer = _client(srv).chat.completions.create(model=FOUND[0], messages=HI, max_tokens=1)
            assert answer.model == FOUND[0]
            assert [c["state"] for c in states(http).values()] == ["unloaded", "loaded", "unloaded"]
            assert f"unloading {FOUND[1]} (least recently used, to make room for {FOUND[0]})" in srv.log()
            refused = http.post("/models/load", json={"model": DEFAULT})
            assert refused.status_code == 503, refused.text
            error = refused.json()["error"]
            assert error["code"] == "model_too_large" and f"memory budget of {budget} MiB" in error["message"]
            assert [c["state"] for c in states(http).values()] == ["unloaded", "loaded", "unloaded"]
    finally:
        stop_server(srv)


def test_a_model_loads_while_another_streams_at_its_pace_and_unloads_giving_its_memory_back(
        many: ServerProcess, http: httpx.Client) -> None:
    """The default model streams; a request for an unloaded model loads it meanwhile. The stream's inter-token
    latency during the load stays within noise of before (generous bounds: two processes now share the cores),
    and no gap in it comes near the load's length (the event loop never waits for the load). Unloaded, the model's
    engine process is gone and the server's process tree is back to its memory of before the load."""
    arrivals: list[float] = []
    streaming, done = threading.Event(), threading.Event()

    def stream() -> None:
        body = {"model": DEFAULT, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{many.base_url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and not line.endswith("[DONE]"):
                    arrivals.append(time.perf_counter())
                    if len(arrivals) == 40:
                        streaming.set()
                    if done.is_set():
                        return

    reader = threading.Thread(target=stream)
    reader.start()
    assert streaming.wait(60)
    memory_before, engines_before = tree_rss(many.process.pid), engines(many)
    start = time.perf_counter()
    answer = _client(many).chat.completions.create(model=FOUND[0], messages=HI, max_tokens=2)
    end = time.perf_counter()
    done.set()
    reader.join(60)
    assert answer.model == FOUND[0] and states(http)[FOUND[0]]["state"] == "loaded"
    before = [b - a for a, b in zip(arrivals, arrivals[1:]) if b < start]
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if a >= start and b <= end]
    assert len(during) >= 10, (len(during), end - start)
    assert statistics.median(during) <= 3 * statistics.median(before), (statistics.median(before),
                                                                         statistics.median(during))
    assert max(during) < (end - start) / 4, (max(during), end - start)

    loaded = tree_rss(many.process.pid)
    assert loaded > 1.1 * memory_before, (memory_before, loaded)  # an engine process of its own, past the tolerance
    unloaded = http.post("/models/unload", json={"model": FOUND[0]}).json()
    assert unloaded["state"] == "unloaded" and unloaded["max_model_len"] == 512  # known since it loaded
    memory_after = tree_rss(many.process.pid)
    assert abs(memory_after - memory_before) <= 0.1 * memory_before, (memory_before, loaded, memory_after)
    assert engines(many) == engines_before and model_states(http)[FOUND[0]] == 0


def test_a_model_is_never_unloaded_under_a_stream(many: ServerProcess, http: httpx.Client) -> None:
    body = {"model": DEFAULT, "prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{many.base_url}/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        refused = http.post("/models/unload", json={"model": DEFAULT})
        assert (refused.status_code, refused.json()["error"]["code"]) == (409, "model_busy"), refused.text
        rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
    assert states(http)[DEFAULT]["state"] == "loaded"


def test_a_model_whose_engine_dies_is_unloaded_then_loads_again(many: ServerProcess, http: httpx.Client) -> None:
    pid = int(re.findall(rf"loaded {FOUND[1]} in [\d.]+s \(engine process (\d+),", many.log())[-1])
    assert pid in engines(many)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while states(http)[FOUND[1]]["state"] != "unloaded":
        assert time.monotonic() < deadline, many.log()
        time.sleep(0.1)
    assert not wait_gone({pid}) and http.get("/health").status_code == 200
    assert [c["state"] for c in states(http).values()] == ["loaded", "loaded", "unloaded", "unloaded", "unloaded"]
    answer = _client(many).chat.completions.create(model=FOUND[1], messages=HI, max_tokens=1)
    assert answer.model == FOUND[1] and len(engines(many)) == 3


def test_sigterm_with_several_models_loaded_exits_0_and_leaves_no_process(many: ServerProcess,
                                                                         http: httpx.Client) -> None:
    assert [c["state"] for c in states(http).values()] == ["loaded", "loaded", "unloaded", "unloaded", "loaded"]
    children = descendants(many.process.pid)
    assert len(engines(many)) == 3
    many.process.send_signal(signal.SIGTERM)
    assert many.process.wait(timeout=60) == 0, many.log()
    assert not wait_gone(children), children
    assert "unloading tiny-llama (the server stops)" in many.log()


# ---- --max-loaded-models 1, --idle-unload, --load-timeout ----

def retried(http: httpx.Client, path: str, body: dict[str, Any], stream: bool = False) -> httpx.Response:
    """The answer once the model has loaded: a load longer than --load-timeout answers 503 `model_loading` with
    Retry-After, and goes on meanwhile."""
    deadline = time.monotonic() + 60
    while True:
        r = http.send(http.build_request("POST", path, json=body), stream=stream)
        if r.status_code != 503 or time.monotonic() > deadline:
            return r
        r.read()
        assert r.json()["error"]["code"] == "model_loading", r.text
        r.close()


def test_one_loaded_model_idle_unloaded_least_recently_used_unloaded_never_under_a_stream(
        lru: ServerProcess) -> None:
    wait_ready(lru)
    with httpx.Client(base_url=lru.base_url, timeout=120) as http:
        # Nobody uses the default model for --idle-unload seconds: unloaded, its engine process gone; the server
        # stays ready (a request loads what it names).
        deadline = time.monotonic() + 60
        while states(http)[FOUND[1]]["state"] != "unloaded" or engines(lru):
            assert time.monotonic() < deadline, lru.log()
            time.sleep(0.2)
        assert model_states(http) == {FOUND[1]: 0, DEFAULT: 0} and f"unloading {FOUND[1]} (idle for 2 s)" in lru.log()
        assert http.get("/health").status_code == 200
        # A stream holds its model: past --load-timeout the other model finds no room (503 with Retry-After), and
        # past --idle-unload the streaming model is still loaded.
        body = {"model": DEFAULT, "prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True,
                "stream": True}
        r = retried(http, "/v1/completions", body, stream=True)
        try:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            refused = http.post("/v1/chat/completions", json={"model": FOUND[1], "messages": HI, "max_tokens": 1})
            assert refused.status_code == 503 and int(refused.headers["Retry-After"]) > 0, refused.text
            error = refused.json()["error"]
            assert error["code"] == "no_room_for_model" and "--max-loaded-models 1" in error["message"], error
            time.sleep(1)  # over --idle-unload since the stream's request came
            assert states(http)[DEFAULT]["state"] == "loaded"
            rest = [line for line in lines if line.startswith("data:")]
        finally:
            r.close()
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
        # Now idle, the streaming model is the least recently used: unloaded to make room.
        r = retried(http, "/v1/chat/completions", {"model": FOUND[1], "messages": HI, "max_tokens": 1})
        assert r.status_code == 200 and r.json()["model"] == FOUND[1], r.text
        cards = states(http)
        assert (cards[DEFAULT]["state"], cards[FOUND[1]]["state"]) == ("unloaded", "loaded")
        assert f"unloading {DEFAULT} (least recently used, to make room for {FOUND[1]})" in lru.log()
        assert len(engines(lru)) == 1
