"""The wire between the HTTP and engine processes (server/process/wire.py), in this process: a ChoiceDelta crosses
as a plain tuple and comes back equal, the rarer events cross as they are, and what the engine process tells the HTTP process of its model
(`ServedModel`) survives pickling with everything the HTTP side reads of a runner."""
from __future__ import annotations

import multiprocessing
import pickle
from dataclasses import asdict, fields
from typing import Any

import pytest
import torch

from engine import Runner, load_runner
from server.scheduling.loading import model_state
from server.scheduling.embedding_jobs import EmbeddingsDone
from server.process.wire import ToClient, ToEngine, decode_event, encode_event, is_final
from server.scheduling.model_state import CacheLayout, PoolStats, ServedModel
from server.scheduling.generation import ChoiceDelta, GenerationDone, GenerationFailed, PromptLogprobs, PositionLogprobs
from server.config.settings import Settings

LOGPROBS = [PositionLogprobs(504, -0.25, [(504, -0.25), (12, -1.5)]), PositionLogprobs(7, -3.0, [(9, -0.5), (7, -3.0)])]
DELTAS = {
    "plain": ChoiceDelta(0, " Paris", [7042]),
    "logprobs": ChoiceDelta(1, " is it", [504, 7], LOGPROBS),
    "empty logprobs": ChoiceDelta(2, "", [], [], "length"),
    "stop string": ChoiceDelta(0, ".", [30], None, "stop", "\n"),
    "stop token": ChoiceDelta(3, "", [2], LOGPROBS[:1], "stop", 2),
}


def _through_a_pipe(item: Any) -> Any:
    """`item` sent over a real multiprocessing pipe (what joins the two processes) and received."""
    a, b = multiprocessing.Pipe()
    try:
        a.send(item)
        return b.recv()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("delta", DELTAS.values(), ids=DELTAS.keys())
def test_a_choice_delta_crosses_as_a_tuple_and_comes_back_equal(delta: ChoiceDelta) -> None:
    wire = encode_event(delta)
    assert type(wire) is tuple  # plain data: no dataclass to pickle per event
    assert all(type(x) in (int, str, float, list, type(None)) for x in wire), wire
    back = decode_event(_through_a_pipe(wire))
    assert type(back) is ChoiceDelta and back == delta  # every field, `at` (the worker's clock) too
    assert back.at == delta.at
    if delta.logprobs:
        assert all(type(lp) is PositionLogprobs for lp in back.logprobs)
        assert [lp.top for lp in back.logprobs] == [lp.top for lp in delta.logprobs]
    assert not is_final(back)


EVENTS = {
    "prompt logprobs": PromptLogprobs([None, PositionLogprobs(5, -1.0, [(5, -1.0)])]),
    "done": GenerationDone(12, 8, 4),
    "failed": GenerationFailed(400, "the grammar cannot be compiled", "bad_grammar"),
}


@pytest.mark.parametrize("event", EVENTS.values(), ids=EVENTS.keys())
def test_the_other_events_pass_through(event: Any) -> None:
    assert encode_event(event) is event and decode_event(event) is event
    back = decode_event(_through_a_pipe(encode_event(event)))
    assert type(back) is type(event) and back == event
    assert is_final(back) == (not isinstance(event, PromptLogprobs))


def test_embeddings_cross_with_their_values() -> None:
    vectors = torch.nn.functional.normalize(torch.randn(3, 576, generator=torch.Generator().manual_seed(0)), dim=1)
    done = EmbeddingsDone(vectors, 17)
    assert encode_event(done) is done
    back = decode_event(_through_a_pipe(encode_event(done)))
    assert type(back) is EmbeddingsDone and back.prompt_tokens == 17
    assert back.embeddings.dtype == torch.float32 and torch.equal(back.embeddings, vectors)
    assert is_final(back)


# ---- ServedModel: the model's facts, for the HTTP process ----

@pytest.fixture(scope="module")
def minilm() -> Runner:
    return load_runner("all-minilm-l6-v2")


def _facts(m: Runner | ServedModel) -> dict[str, Any]:
    """What the HTTP side reads of `ModelState.model`, the tokenizer and the cache aside."""
    return {f.name: getattr(m, f.name) for f in fields(ServedModel) if f.name not in ("tokenizer", "blocks")}


@pytest.mark.parametrize("which", ["smollm", "minilm"])
def test_a_served_model_pickles_with_the_runners_facts(request: pytest.FixtureRequest, which: str) -> None:
    runner: Runner = request.getfixturevalue(which)
    served = pickle.loads(pickle.dumps(ServedModel.of(runner)))
    assert _facts(served) == _facts(runner)
    assert served.generation_defaults is not runner.generation_defaults  # a copy, not the runner's own dict
    if runner.blocks is None:  # an encoder: no KV cache
        assert served.blocks is None and served.is_encoder
    else:
        assert served.blocks == CacheLayout(runner.blocks.block_size, runner.blocks.prefix_caching)
        assert not served.is_encoder and served.generation_defaults  # SmolLM2's own sampling defaults
    tok = served.tokenizer
    assert tok is not runner.tokenizer
    text = "The capital of France is <|im_start|> Paris."
    assert tok.encode(text) == runner.tokenizer.encode(text)
    assert tok.decode(tok.encode(text)) == runner.tokenizer.decode(runner.tokenizer.encode(text))
    assert tok.end_token_ids == runner.tokenizer.end_token_ids


@pytest.mark.parametrize("which", ["smollm", "minilm"])
def test_model_state_of_a_served_model_equals_the_runners(request: pytest.FixtureRequest, which: str) -> None:
    """The HTTP process builds its ModelState from the ServedModel that came over the pipe: the same model id,
    fingerprint (made of the model's facts) and limits as the one-process server's from the runner."""
    runner: Runner = request.getfixturevalue(which)
    settings = Settings(model=which, embeddings=True)
    served = pickle.loads(pickle.dumps(ServedModel.of(runner)))
    pool = object()
    mine, theirs = model_state(settings, runner, pool, False), model_state(settings, served, pool, False)
    assert theirs.model is served and theirs.pool is pool
    for name in ("model_id", "fingerprint", "embeddings", "max_prompt_tokens", "stream_interval", "pooling"):
        assert getattr(theirs, name) == getattr(mine, name), name


def test_settings_cross_to_the_engine_process() -> None:
    """The engine process is spawned with the settings: they pickle, the API key (a secret) with them."""
    settings = Settings(model="smollm2-135m", api_key="sk-test", engine_process=True, max_num_seqs=7,
                        allowed_origins=["https://example.com"])
    back = pickle.loads(pickle.dumps(settings))
    assert back == settings and back.api_key.get_secret_value() == "sk-test"


def test_every_message_kind_has_a_handler_on_the_receiving_side() -> None:
    """Each kind the HTTP process can send the engine (ToEngine) is answered by the engine side's table (STOP by
    its `serve` loop), and each kind the engine can send (ToClient) by the client's (READY and LOAD_FAILED by
    `wait_ready`, before the pipe is attached): a kind added without a handler fails here."""
    from server.process.client import EngineClient
    from server.process.engine import EngineSide

    assert set(EngineSide.HANDLERS) | {ToEngine.STOP} == set(ToEngine)
    assert ToEngine.STOP not in EngineSide.HANDLERS
    assert set(EngineClient.HANDLERS) | EngineClient.LOAD_MESSAGES == set(ToClient)
    assert not set(EngineClient.HANDLERS) & EngineClient.LOAD_MESSAGES


def test_a_message_kind_crosses_as_its_plain_string() -> None:
    """The kinds are sent as their values: as small on the wire as a bare string, and still found in the tables."""
    for kind in (*ToEngine, *ToClient):
        assert type(kind.value) is str
        back = _through_a_pipe((kind.value, 1))
        assert type(back[0]) is str and back[0] == kind
    assert len(pickle.dumps((ToClient.EVENTS.value, []), pickle.HIGHEST_PROTOCOL)) == len(
        pickle.dumps(("events", []), pickle.HIGHEST_PROTOCOL))
    from server.process.client import EngineClient
    assert EngineClient.HANDLERS["events"] is EngineClient.HANDLERS[ToClient.EVENTS]


def test_pool_stats_cross_the_pipe_and_match_the_health_body() -> None:
    """`PoolStats` crosses as it is, and GET /health's `Health` has a field for each of its figures (so that none
    is dropped or read under another name)."""
    from server.api.openai.protocol import Health

    stats = PoolStats(running=2, queued=1, kv_blocks_total=8, speculative="ngram",
                      spec_decode_num_accepted_tokens_per_pos=[3, 1], spec_decode_acceptance_rate=0.5)
    assert _through_a_pipe(stats) == stats
    assert {f.name for f in fields(PoolStats)} <= set(Health.model_fields)
    health = Health(status="ok", model="m", device="cpu", dtype="float32", quant="none", deterministic=True,
                    **asdict(stats))
    assert health.model_dump(exclude={"status", "model", "device", "dtype", "quant", "deterministic"}) == asdict(stats)
