"""The in-process Generator on the session's SmolLM2 runner (float32, the exact path): greedy outputs are the
engine's greedy reference, concurrent calls are batched by the worker and get what each gets alone, a cancelled
stream or call frees its KV blocks, per-call overrides and presets reach the sampler, bad values are
GenerationErrors; and the builder with the sync wrapper loads the real model once."""
from __future__ import annotations

import asyncio
import gc
import json
import pickle
import time
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeVar

import jsonschema
import pytest

from engine import Runner
from engine.errors import ModelNotPulledError
from server import GeneratedText, GenerationError, Generator, SyncGenerator
from server.config.presets import PRESETS
from tests.support.greedy_reference import Reference, spanning_stop

T = TypeVar("T")
GREEDY = {"temperature": 0.0}
PROMPTS = [f"Here is a short list of {thing}:" for thing in
           ("fruits", "colors", "rivers", "birds", "tools", "games", "trees", "stars", "cities", "metals",
            "poems", "clouds", "ships", "songs", "shoes", "bells")]
ASK = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def ref(smollm: Runner) -> Reference:
    return Reference(smollm)


def run_with(runner: Runner, scenario: Callable[[Generator], Awaitable[T]], config: dict[str, Any] | None = None,
             **settings: Any) -> T:
    """`scenario(generator)` on a Generator serving `runner`, closed afterwards (one worker owns a runner at once)."""
    async def main() -> T:
        async with Generator.from_runner(runner, config, **settings) as gen:
            return await scenario(gen)

    return asyncio.run(main())


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_greedy_generate_is_the_engines_greedy_reference(smollm: Runner, ref: Reference) -> None:
    text_prompt = "The three primary colors are"
    results = run_with(smollm, lambda gen: asyncio.gather(gen.generate(text_prompt), gen.generate(ASK)),
                       {**GREEDY, "max_tokens": 8})
    for result, ids in zip(results, (smollm.tokenizer.encode(text_prompt), ref.chat_ids(ASK))):
        expected = ref.generate(ids, 8)
        assert result.token_ids == expected
        assert result.text == ref.text(expected) and result.finish_reason == ref.finish_reason(expected)
        assert result.prompt_tokens == len(ids) and result.config.temperature == 0.0
        rows = ref.logprobs(ids, expected)
        for i, (token, logprob) in enumerate(zip(expected, result.logprobs, strict=True)):
            assert logprob == pytest.approx(float(rows[i, token]), abs=1e-3)


def test_the_result_is_the_text_as_a_str_carrying_the_generations_facts(smollm: Runner, ref: Reference) -> None:
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    result = run_with(smollm, lambda gen: gen.generate(ask), {**GREEDY, "max_tokens": 12})
    expected = ref.generate(ref.chat_ids(ask), 12)
    text = ref.text(expected)
    assert isinstance(result, str) and isinstance(result, GeneratedText)
    assert result == text and "Paris" in result and result[:5] == text[:5] and result.upper() == text.upper()
    assert json.loads(json.dumps({"answer": result})) == {"answer": text}
    assert type(result.text) is str and type(str(result)) is str and result.text == text and f"{result}" == text
    assert result.token_ids == expected and len(result.logprobs) == len(expected)
    assert result.finish_reason == ref.finish_reason(expected) and result.config.temperature == 0.0
    assert result.prompt_tokens == len(ref.chat_ids(ask)) and result.cached_tokens >= 0
    with pytest.raises(AttributeError, match="immutable"):
        result.finish_reason = "length"  # type: ignore[misc]
    again = pickle.loads(pickle.dumps(result))
    assert again == result and again.token_ids == result.token_ids and again.config == result.config


def test_sixteen_concurrent_calls_are_batched_and_get_what_each_gets_alone(smollm: Runner) -> None:
    overrides = {**GREEDY, "max_tokens": 4, "ignore_eos": True}

    async def scenario(gen: Generator) -> None:
        alone = [await gen.generate_with_config(p, overrides) for p in PROMPTS]
        scheduler = gen.state.pool.workers[0].scheduler
        assert scheduler.peak_running == 1
        together = await asyncio.gather(*(gen.generate_with_config(p, overrides) for p in PROMPTS))
        assert [r.token_ids for r in together] == [r.token_ids for r in alone]
        assert all(len(r.token_ids) == 4 for r in alone)
        assert scheduler.peak_running > 1, "the calls ran one after another"

    run_with(smollm, scenario)


def test_a_cancelled_stream_or_call_frees_its_kv_blocks(smollm: Runner) -> None:
    async def scenario(gen: Generator) -> None:
        blocks, scheduler = smollm.blocks, gen.state.pool.workers[0].scheduler
        held = blocks.num_used  # the shared runner's own session, if any
        long = {**GREEDY, "max_tokens": 300, "ignore_eos": True}
        async with aclosing(gen.stream(PROMPTS[0] * 4, long)) as tokens:
            seen = []
            async for token in tokens:
                seen.append(token)
                if len(seen) == 3:
                    assert blocks.num_used > held and scheduler.num_generations == 1
                    break
        await until(lambda: scheduler.num_generations == 0 and blocks.num_used == held)
        assert all(isinstance(t.id, int) and t.logprob <= 0 for t in seen)

        made = scheduler.generated_tokens
        call = asyncio.create_task(gen.generate_with_config(PROMPTS[1] * 4, long))
        await until(lambda: scheduler.generated_tokens > made + 2 and blocks.num_used > held)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await until(lambda: scheduler.num_generations == 0 and blocks.num_used == held)

    run_with(smollm, scenario)


def test_a_stream_carries_the_generations_tokens_and_text(smollm: Runner) -> None:
    async def scenario(gen: Generator) -> tuple[Any, list[Any], list[str]]:
        whole = await gen.generate(ASK)
        tokens = [t async for t in gen.stream(ASK)]
        pieces = [p async for p in gen.stream_text(ASK)]
        return whole, tokens, pieces

    whole, tokens, pieces = run_with(smollm, scenario, {**GREEDY, "max_tokens": 8})
    assert [t.id for t in tokens] == whole.token_ids
    assert "".join(t.text for t in tokens) == "".join(pieces) == whole.text
    assert [t.logprob for t in tokens] == pytest.approx(whole.logprobs, abs=1e-3)
    assert tokens[-1].finish_reason == whole.finish_reason and all(t.finish_reason is None for t in tokens[:-1])


def test_per_call_overrides_replace_the_generators_values_for_that_call(smollm: Runner, ref: Reference) -> None:
    prompt = "1, 2, 3, 4, 5,"
    ids = smollm.tokenizer.encode(prompt)
    greedy = ref.generate(ids, 8)
    full = ref.text(greedy)
    stop, _ = spanning_stop(ref.text, greedy, 1)  # a piece of the greedy continuation across tokens 1 to 3

    async def scenario(gen: Generator) -> None:
        base = await gen.generate(prompt)
        assert len(base.token_ids) == 8 and base.config.max_tokens == 8
        short = await gen.generate_with_config(prompt, {"max_tokens": 3})
        assert short.token_ids == base.token_ids[:3] and short.finish_reason == "length"
        cut = await gen.generate_with_config(prompt, {"stop": [stop]})
        assert cut.text == full[:full.index(stop)] and cut.finish_reason == "stop"
        warm = await gen.generate_with_config(prompt, {"temperature": 0.8, "top_k": 5, "seed": 3})
        assert (warm.config.temperature, warm.config.top_k, warm.config.seed) == (0.8, 5, 3)
        assert (await gen.generate_with_config(prompt, {"temperature": 0.8, "top_k": 5, "seed": 3})).token_ids == \
            warm.token_ids
        assert gen.generation_config.temperature == 0.0 and gen.generation_config.max_tokens == 8

    run_with(smollm, scenario, {**GREEDY, "max_tokens": 8})


def test_presets_apply_under_the_values_a_call_sets(smollm: Runner, ref: Reference) -> None:
    precise, creative = PRESETS["precise"], PRESETS["creative"]

    async def scenario(gen: Generator) -> None:
        config = gen.generation_config  # the generator's preset over the model's defaults (temperature 0.2)
        assert (config.preset, config.max_tokens) == ("precise", precise.max_tokens)
        assert {k: getattr(config, k) for k in precise.sampling()} == precise.sampling()
        result = await gen.generate_with_config(ASK, {"max_tokens": 8})  # greedy: precise's temperature 0
        assert result.token_ids == ref.generate(ref.chat_ids(ASK), 8)
        other = await gen.generate_with_config(ASK, {"preset": "creative", "max_tokens": 2})
        assert other.config.preset == "creative" and other.config.max_tokens == 2
        assert {k: getattr(other.config, k) for k in creative.sampling()} == creative.sampling()
        mine = await gen.generate_with_config(ASK, {"preset": "creative", "max_tokens": 2, "temperature": 0.3})
        assert mine.config.temperature == 0.3 and mine.config.top_k == creative.top_k

    run_with(smollm, scenario, preset="precise")


def test_bad_values_are_generation_errors_naming_the_field(smollm: Runner) -> None:
    async def scenario(gen: Generator) -> None:
        with pytest.raises(GenerationError) as unknown:
            await gen.generate_with_config("Hi", {"preset": "nope"})
        assert unknown.value.status == 400 and unknown.value.param == "preset"
        assert all(name in unknown.value.message for name in PRESETS)
        with pytest.raises(GenerationError) as hot:
            await gen.generate_with_config("Hi", {"temperature": 5.0})
        assert hot.value.param == "temperature"
        with pytest.raises(GenerationError, match="unknown generation settings: temp"):
            await gen.generate_with_config("Hi", {"temp": 1.0})
        with pytest.raises(GenerationError) as empty:
            await gen.generate("")
        assert empty.value.param == "prompt"
        with pytest.raises(GenerationError) as long:
            await gen.generate_with_config("Hi", {"max_tokens": gen.context_size})
        assert long.value.code == "context_length_exceeded"
        assert (await gen.generate_with_config("Hi", {"max_tokens": 1})).finish_reason == "length"  # still serving

    run_with(smollm, scenario)
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        Generator.builder("smollm2-135m").preset("nope")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        Generator.builder("smollm2-135m").draft("self-int4", 0).settings()
    with pytest.raises(ValueError, match="encoder"):
        asyncio.run(Generator.builder("all-minilm-l6-v2").build())


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_a_json_schema_response_format_holds_the_output_to_the_schema(smollm: Runner) -> None:
    """Structured outputs through the HTTP API's own preparation: JSON valid against the schema, for a chat and a
    text prompt alike; a schema that is no JSON Schema is a GenerationError naming the field."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    async def scenario(gen: Generator) -> list[Any]:
        ask = [{"role": "user", "content": "Describe a person as JSON."}]
        results = await asyncio.gather(gen.generate(ask), gen.generate("A person, as JSON:"))
        with pytest.raises(GenerationError) as bad:
            await gen.generate_with_config("Hi", {"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": 5}}}})
        assert bad.value.status == 400 and bad.value.param == "response_format.json_schema.schema"
        regex = await gen.generate_with_config("Hi", {"structured_outputs": {"regex": "[0-9]{3}"},
                                                      "response_format": {"type": "text"}})
        assert regex.text.isdigit() and len(regex.text) == 3
        return results

    results = run_with(smollm, scenario, {**GREEDY, "max_tokens": 64, "response_format": fmt})
    for result in results:
        assert result.finish_reason == "stop", result.text
        jsonschema.validate(json.loads(result.text), PERSON)
        assert result.config.response_format == fmt


def test_the_builder_and_the_sync_wrapper_serve_the_real_model(smollm: Runner, ref: Reference) -> None:
    prompt = "The three primary colors are"
    expected = ref.generate(smollm.tokenizer.encode(prompt), 6)
    builder = (Generator.builder("smollm2-135m").cpu().precise().max_tokens(6).prefix_cache(False).offline().quiet()
               .setting("dtype", "float32").setting("max_context", 512).draft("self-int4", 3))
    with builder.build_sync() as gen:
        assert isinstance(gen, SyncGenerator)
        assert (gen.model_name, gen.device, gen.context_size, gen.vocab_size) == \
            ("smollm2-135m", "cpu", 512, smollm.vocab_size)
        assert gen.generation_config.temperature == 0.0 and gen.generation_config.max_tokens == 6
        result = gen.generate(prompt)
        assert isinstance(result, str) and result == ref.text(expected) and result.token_ids == expected
        batch = gen.generate_batch([prompt, ASK, prompt])
        assert batch[0].token_ids == batch[2].token_ids == expected
        assert batch[1].token_ids == ref.generate(ref.chat_ids(ASK), 6)
        assert "".join(gen.stream_text(prompt)) == ref.text(expected)
        # the int4 draft's tokens were verified by the float32 target, which kept its own greedy tokens above
        spec = gen.generator.state.pool.stats()
        assert spec.speculative == "draft" and spec.spec_decode_num_accepted_tokens > 0, spec
        runner = gen.generator.state.pool.workers[0].runner
        for i, _ in enumerate(gen.stream(prompt, {"max_tokens": 200, "ignore_eos": True})):
            if i == 2:
                break  # closing the iterator cancels the generation
        deadline = time.monotonic() + 10
        while runner.blocks.num_used and time.monotonic() < deadline:
            time.sleep(0.01)
        assert runner.blocks.num_used == 0
    with pytest.raises(GenerationError, match="closed"):
        asyncio.run(gen.generator.generate(prompt))


def test_offline_refuses_a_model_not_pulled_and_contradicts_pull() -> None:
    with pytest.raises(ModelNotPulledError, match=r"run: emberserve pull nobody/nothing-GGUF:Q8_0"):
        Generator.builder("nobody/nothing-GGUF:Q8_0").offline().quiet().build_sync()
    with pytest.raises(ValueError, match=r"offline\(\) and pull\(\) contradict each other"):
        Generator.builder("nobody/nothing-GGUF:Q8_0").offline().pull().build_sync()


def test_serving_freezes_the_heap_it_starts_with_and_a_stopped_pool_lets_it_go(smollm: Runner) -> None:
    """The collector's full collections do not walk what was alive when serving started (the pool freezes it:
    server/scheduling/worker.py), and once the pool stops it is collectable again."""
    gc.unfreeze()
    junk = [[i] for i in range(1000)]  # alive before serving starts: frozen with the rest

    async def frozen(gen: Generator) -> int:
        await gen.generate_with_config("Hi", {"max_tokens": 2, **GREEDY})
        return gc.get_freeze_count()

    assert run_with(smollm, frozen) >= len(junk)
    assert gc.get_freeze_count() == 0
