"""Thin endpoint functions: parse, hand to the serving objects, return."""
from __future__ import annotations

from dataclasses import asdict
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from server import __version__
from server.errors import APIError, invalid
from server.api.openapi import PROMETHEUS_TEXT, RETRY_AFTER, anthropic_errors, errors
from server.api.openai.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
    CompletionResponse, DetokenizeRequest, DetokenizeResponse, EmbeddingRequest, EmbeddingResponse, Health,
    HealthUnavailable, Liveness, ModelCard, ModelList, ModelRequest, PresetCard, PresetList, TokenizeRequest,
    TokenizeResponse, VersionInfo)
from server.api.anthropic.protocol import CountTokensRequest, MessageResponse, MessagesRequest, TokenCount
from server.api.responses.protocol import InputItemList, ResponseDeleted, ResponseObject, ResponsesRequest
from server.api.openai.serving import check_model, check_token_ids, prompt_work
from server.api.model_router import ModelRouter, model_card
from server.api.responses.serving import StoredResponseReads
from server.scheduling.model_state import ModelState, PoolStats
from server.api.openai.chat import chat_prompt_ids
from server.api.state import Servings, app_state
from server.config.presets import PRESETS

router = APIRouter()
LOADING_RETRY_AFTER_S = "5"
T = TypeVar("T")


def _state(request: Request) -> ModelState:
    state = app_state(request.app).model
    if state is None:
        raise APIError(503, "the model is still loading; retry shortly", code="model_loading",
                       headers={"Retry-After": LOADING_RETRY_AFTER_S})
    return state


def _servings(request: Request) -> Servings:
    """The API's serving objects (503 while the model loads: they are set with it)."""
    _state(request)
    serving = app_state(request.app).serving
    assert serving is not None  # set together with the model, in one turn of the event loop
    return serving


def _state_for(request: Request, model: str | None) -> ModelState:
    """The served model, checked against the optional `model` a utility request names."""
    state = _state(request)
    if model is not None:
        check_model(state, model)
    return state


async def _serve(request: Request, model: str | None, call: Callable[[Servings], Awaitable[T]]) -> T:
    """`call` with the serving objects of the model the request names: the served model's (the one-model server
    checks the name in the serving object), or on a multi-model server that model's, loaded first if need be and
    held until `call` returns."""
    router = app_state(request.app).router
    if router is None:
        return await call(_servings(request))
    async with router.use(model) as used:
        return await call(used.serving)


async def _with_state(request: Request, model: str | None, call: Callable[[ModelState], Awaitable[T]]) -> T:
    """`call` with the state of the model a utility request names (None: the served, or default, model)."""
    router = app_state(request.app).router
    if router is None:
        return await call(_state_for(request, model))
    async with router.use(model) as used:
        return await call(used.model)


def _stored_responses(request: Request) -> StoredResponseReads:
    """What reads the stored responses of /v1/responses (a multi-model server's models share one store)."""
    stored = app_state(request.app).stored_responses
    return _servings(request).responses if stored is None else stored


def _unavailable(status: str, headers: dict[str, str] | None = None) -> JSONResponse:
    body = HealthUnavailable(status=status).model_dump(exclude_none=True)
    return JSONResponse(body, status_code=503, headers=headers)


@router.get("/livez", response_model=Liveness, summary="liveness: 200 while the process answers HTTP")
async def livez() -> Liveness:
    return Liveness(status="alive")


@router.get("/version", response_model=VersionInfo, summary="the server's version")
async def version() -> VersionInfo:
    return VersionInfo(version=__version__)


@router.get("/health", response_model=Health,
            responses={503: {"model": HealthUnavailable, "headers": RETRY_AFTER,
                             "description": "the model is still loading (with Retry-After), or the server drains"}},
            summary="readiness: 503 while the model loads or the server drains, 200 when ready")
async def health(request: Request) -> Health | JSONResponse:
    server = app_state(request.app)
    state = server.model
    if server.draining:
        return _unavailable("draining")
    if server.router is not None:
        return await _models_health(server.router)
    if state is None:
        return _unavailable("loading", headers={"Retry-After": LOADING_RETRY_AFTER_S})
    failure = state.pool.failure
    if failure is not None:
        return JSONResponse(HealthUnavailable(status="unhealthy", error=failure).model_dump(exclude_none=True),
                            status_code=503)
    model = state.model
    await state.pool.refresh_stats()
    return Health(status="ok", model=state.model_id, device=str(model.device),
                  dtype=str(model.dtype).removeprefix("torch."), quant=model.quant,
                  deterministic=model.deterministic, **asdict(state.pool.stats()))


async def _models_health(models: ModelRouter[Servings]) -> Health | JSONResponse:
    """A multi-model server's readiness: once its default model has loaded (and from then on, its models loading
    and unloading as requests come); the default model's figures (zeros while it is unloaded) and every model's
    state."""
    if not models.started:
        return _unavailable("loading", headers={"Retry-After": LOADING_RETRY_AFTER_S})
    default = models.default
    facts, state = default.facts, default.model
    assert facts is not None  # known since it first loaded
    stats = PoolStats()
    if state is not None:
        await state.pool.refresh_stats()
        stats = state.pool.stats()
    return Health(status="ok", model=default.id, device=facts.device, dtype=facts.dtype, quant=facts.quant,
                  deterministic=facts.deterministic, **asdict(stats), models=models.states())


@router.get("/metrics", response_class=Response,
            responses={200: {"description": "Prometheus text exposition format 0.0.4",
                             "content": {PROMETHEUS_TEXT: {"schema": {"type": "string"}}}}},
            summary="Prometheus metrics, named as vLLM's with the prefix emberserve:")
async def metrics(request: Request) -> Response:
    server = app_state(request.app)
    if server.model is not None:
        await server.model.pool.refresh_stats()  # what the scrape's pool figures read
    if server.router is not None:
        await server.router.refresh_stats()
    body, content_type = server.metrics.exposition()
    return Response(body, media_type=content_type)


@router.get("/v1/models", response_model=ModelList, responses=errors(503))
async def list_models(request: Request) -> ModelList:
    models = app_state(request.app).router
    if models is not None:
        return ModelList(data=models.cards())
    return ModelList(data=[model_card(_state(request))])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=errors(404, 503))
async def get_model(model_id: str, request: Request) -> ModelCard:
    models = app_state(request.app).router
    if models is not None:
        return models.card(models.manager.find(model_id))
    return model_card(_state_for(request, model_id))


@router.get("/v1/presets", response_model=PresetList,
            summary="the named sampling presets a request may give as `preset` (emberserve's extension)")
async def list_presets(request: Request) -> PresetList:
    return PresetList(data=[PresetCard(**asdict(p)) for p in PRESETS.values()],
                      default=app_state(request.app).settings.preset)


# 200 is a JSON body, or with `stream: true` an event stream (its event schema is added by server/api/openapi.py).
_GENERATION_ERRORS = errors(400, 404, 413, 429, 503)
_UTILITY_ERRORS = errors(400, 404, 413, 503)


@router.post("/v1/chat/completions", response_model=None,
             responses={200: {"model": ChatCompletionResponse}, **_GENERATION_ERRORS})
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    return await _serve(request, body.model, lambda serving: serving.chat.create(body, request))


@router.post("/v1/completions", response_model=None,
             responses={200: {"model": CompletionResponse}, **_GENERATION_ERRORS})
async def completions(body: CompletionRequest, request: Request) -> Any:
    return await _serve(request, body.model, lambda serving: serving.completions.create(body, request))


@router.post("/v1/responses", response_model=None,
             responses={200: {"model": ResponseObject}, **_GENERATION_ERRORS})
async def create_response(body: ResponsesRequest, request: Request) -> Any:
    return await _serve(request, body.model, lambda serving: serving.responses.create(body, request))


_STORED_ERRORS = errors(404, 503)


@router.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=_STORED_ERRORS,
            summary="a stored response (one made with store: true, until the store drops it)")
async def retrieve_response(response_id: str, request: Request) -> ResponseObject:
    return await _stored_responses(request).retrieve(response_id)


@router.delete("/v1/responses/{response_id}", response_model=ResponseDeleted, responses=_STORED_ERRORS)
async def delete_response(response_id: str, request: Request) -> ResponseDeleted:
    return await _stored_responses(request).delete(response_id)


@router.get("/v1/responses/{response_id}/input_items", response_model=InputItemList,
            responses=errors(400, 404, 503), summary="the input items of a stored response")
async def response_input_items(response_id: str, request: Request, limit: int = Query(20, ge=1, le=100),
                               order: Literal["asc", "desc"] = "desc", after: str | None = None) -> InputItemList:
    return await _stored_responses(request).input_items(response_id, limit, order, after)


@router.post("/v1/messages", response_model=None,
             responses={200: {"model": MessageResponse}, **anthropic_errors(400, 404, 413, 429, 503)},
             summary="Anthropic's Messages API (errors in Anthropic's envelope)")
async def messages(body: MessagesRequest, request: Request) -> Any:
    return await _serve(request, body.model, lambda serving: serving.messages.create(body, request))


@router.post("/v1/messages/count_tokens", response_model=TokenCount,
             responses=anthropic_errors(400, 404, 413, 503))
async def count_message_tokens(body: CountTokensRequest, request: Request) -> TokenCount:
    return await _serve(request, body.model, lambda serving: serving.messages.count_tokens(body))


@router.post("/v1/embeddings", response_model=None,
             responses={200: {"model": EmbeddingResponse}, **_GENERATION_ERRORS})
async def embeddings(body: EmbeddingRequest, request: Request) -> Any:
    return await _serve(request, body.model, lambda serving: serving.embeddings.create(body, request))


@router.post("/tokenize", response_model=TokenizeResponse, responses=_UTILITY_ERRORS)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    return await _with_state(request, body.model, lambda state: _tokenize(state, body))


async def _tokenize(state: ModelState, body: TokenizeRequest) -> TokenizeResponse:
    if (body.prompt is None) == (body.messages is None):
        raise invalid("give exactly one of prompt or messages", param="prompt")
    if body.messages is not None:
        ids = await prompt_work(chat_prompt_ids, state, body.messages, body.add_generation_prompt, None,
                                body.chat_template_kwargs, body.reasoning_effort)
    else:
        ids = await prompt_work(state.model.tokenizer.encode, body.prompt, body.add_special_tokens)
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=state.model.context_size)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=_UTILITY_ERRORS)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    return await _with_state(request, body.model, lambda state: _detokenize(state, body))


async def _detokenize(state: ModelState, body: DetokenizeRequest) -> DetokenizeResponse:
    check_token_ids(body.tokens, state.model.vocab_size, "tokens")
    return DetokenizeResponse(prompt=await prompt_work(state.model.tokenizer.decode, body.tokens))


# A multi-model server's operator routes (create_app adds them only there), behind the API key like every route.
models_router = APIRouter()


@models_router.post("/models/load", response_model=ModelCard, responses=errors(404, 503),
                    summary="load a model now (a multi-model server's; a request for it would load it too)")
async def load_model(body: ModelRequest, request: Request) -> ModelCard:
    models = _router(request)
    return models.card(await models.load(body.model))


@models_router.post("/models/unload", response_model=ModelCard, responses=errors(404, 409),
                    summary="unload a model now, giving its memory back (409 while a request uses it)")
async def unload_model(body: ModelRequest, request: Request) -> ModelCard:
    models = _router(request)
    return models.card(await models.unload(body.model))


def _router(request: Request) -> ModelRouter[Servings]:
    models = app_state(request.app).router
    assert models is not None  # the routes exist only where there is one
    return models
