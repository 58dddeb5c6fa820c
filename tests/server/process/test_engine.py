"""The engine process's end of the pipe (server/process/engine.py), driven in this process through a real pipe: a
constrained generation's grammar compiles off the pipe's thread and the generation then reaches the pool with it;
one cancelled while its grammar compiles never runs; a failing grammar answers with a 400 event."""
from __future__ import annotations

import multiprocessing
import threading
import time
from types import SimpleNamespace
from typing import Any

from server.process.engine import EngineSide, serve_pipes
from server.process.response_store import ResponseStore
from server.scheduling.generation import Generation, GenerationFailed
from server.scheduling.model_state import PoolStats
from server.grammar.compiler import GrammarCompiler, GrammarSpec
from server.sampling.params import SamplingParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


class RecordingPool:
    """Stands in for the WorkerPool: keeps what is submitted."""

    def __init__(self) -> None:
        self.submitted: list[Generation] = []
        self.stopped = threading.Event()

    def submit(self, gen: Generation) -> None:
        self.submitted.append(gen)

    def stop(self) -> None:
        self.stopped.set()

    def stats(self) -> PoolStats:
        return PoolStats(running=len(self.submitted))


def _spec(grammar: GrammarSpec | None) -> dict[str, Any]:
    return {"prompt_ids": [1, 2, 3], "params": SamplingParams(temperature=0), "max_tokens": 4, "n": 1, "stop": [],
            "stop_token_ids": frozenset(), "min_tokens": 0, "ignore_eos": False, "prompt_logprobs": None,
            "request_id": "cmpl-test", "prompt_index": 0, "max_backlog": None, "stream_interval": 1,
            "arrival": time.perf_counter(), "grammar": grammar}


def _serve(grammars: GrammarCompiler, messages: list[list[tuple]], *, submitted: int = 0,
           replies: int = 0) -> tuple[RecordingPool, list[tuple]]:
    """Send `messages` (batches, as the HTTP process writes them), wait for `submitted` generations in the pool
    and `replies` messages back, then stop; what the pool got and every message that came back."""
    here, there = multiprocessing.Pipe()
    pool = RecordingPool()
    side = EngineSide(there)
    serving = threading.Thread(target=serve_pipes, args=(SimpleNamespace(pool=pool, grammars=grammars), side, []))
    serving.start()
    for batch in messages:
        here.send(batch)
    got = [here.recv() for _ in range(replies) if here.poll(30)]
    deadline = time.monotonic() + 30
    while (len(pool.submitted) < submitted or side._compiling) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # a compile that was cancelled has had time to (wrongly) submit
    here.send([("stop",)])
    serving.join(30)
    while here.poll(0.5):
        got.append(here.recv())
    assert pool.stopped.is_set()
    return pool, got


def test_a_constrained_generation_reaches_the_pool_with_its_compiled_grammar(grammars: GrammarCompiler) -> None:
    pool, replies = _serve(grammars, [[("generate", 0, _spec(GrammarSpec.json_schema(SCHEMA))),
                                      ("generate", 1, _spec(None))]], submitted=2)
    by_id = {gen.request_id: gen for gen in pool.submitted}
    assert len(pool.submitted) == 2 and len(by_id) == 1  # both arrive (same request id)
    constrained = [g for g in pool.submitted if g.grammar is not None]
    assert len(constrained) == 1 and constrained[0].grammar.spec == GrammarSpec.json_schema(SCHEMA)
    assert all(g.sink is not None and g.loop is None for g in pool.submitted)
    assert replies == []  # nothing comes back for them


def test_a_generation_cancelled_while_its_grammar_compiles_never_runs(grammars: GrammarCompiler) -> None:
    schema = {**SCHEMA, "properties": {**SCHEMA["properties"], "tag": {"type": "string", "pattern": "^[a-z]{3}$"}}}
    pool, replies = _serve(grammars, [[("generate", 7, _spec(GrammarSpec.json_schema(schema))), ("cancel", 7)]])
    # cancelled before it was registered: never submitted; or registered first: submitted, then cancelled
    assert all(gen.cancelled for gen in pool.submitted), pool.submitted
    assert replies == []  # nothing comes back for them


def test_a_grammar_that_fails_to_compile_answers_with_a_400_event(grammars: GrammarCompiler) -> None:
    bad = GrammarSpec("regex", "(unclosed")
    pool, replies = _serve(grammars, [[("generate", 3, _spec(bad))]], replies=1)
    assert pool.submitted == []
    kind, wire = replies[0]
    assert kind == "events" and wire[0][0] == 3
    assert isinstance(wire[0][1], GenerationFailed) and wire[0][1].status == 400
    assert len(replies) == 1


def test_an_http_process_that_leaves_has_its_generations_cancelled_and_the_engine_serves_on(
        grammars: GrammarCompiler) -> None:
    """Two pipes (the main HTTP process's and another's, sharing one response store): the other's departure
    cancels what came through it and nothing else; both read and write the one store; the main pipe's stop stops
    the pool."""
    main_here, main_there = multiprocessing.Pipe()
    front_here, front_there = multiprocessing.Pipe()
    pool, store = RecordingPool(), ResponseStore(max_items=8, max_age=60)
    main, front = EngineSide(main_there, store), EngineSide(front_there, store)
    serving = threading.Thread(target=serve_pipes, args=(SimpleNamespace(pool=pool, grammars=grammars), main,
                                                          [front]))
    serving.start()
    main_here.send([("generate", 0, _spec(None))])
    front_here.send([("generate", 0, _spec(None)), ("store", 5, "put", "resp_1", {"text": "hi"})])
    assert front_here.poll(30) and front_here.recv() == ("reply", 5, None)
    main_here.send([("store", 9, "get", "resp_1", None)])
    assert main_here.poll(30) and main_here.recv() == ("reply", 9, {"text": "hi"})
    deadline = time.monotonic() + 30
    while len(pool.submitted) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    by_side = {id(gen.sink): gen for gen in pool.submitted}
    front_here.close()  # that HTTP process is gone
    while not by_side[id(front)].cancelled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert by_side[id(front)].cancelled and not by_side[id(main)].cancelled
    assert not pool.stopped.is_set()
    main_here.send([("stats", 11)])
    assert main_here.poll(30) and main_here.recv() == ("reply", 11, PoolStats(running=2))
    main_here.send([("stop",)])
    serving.join(30)
    assert pool.stopped.is_set() and not main_here.poll(0.5)  # nothing more after stop
