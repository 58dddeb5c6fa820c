"""Thin endpoint functions: parse, hand to the serving objects, return."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from .errors import APIError, invalid
from .protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
                       DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList, TokenizeRequest,
                       TokenizeResponse)
from .serving import ModelState, check_model, check_token_ids
from .serving_chat import ChatServing, chat_prompt_ids
from .serving_completions import CompletionServing

router = APIRouter()
LOADING_RETRY_AFTER_S = "5"


def _state(request: Request) -> ModelState:
    state: ModelState | None = request.app.state.model
    if state is None:
        raise APIError(503, "the model is still loading; retry shortly", code="model_loading",
                       headers={"Retry-After": LOADING_RETRY_AFTER_S})
    return state


def _state_for(request: Request, model: str | None) -> ModelState:
    """The served model, checked against the optional `model` a utility request names."""
    state = _state(request)
    if model is not None:
        check_model(state, model)
    return state


def _card(state: ModelState) -> ModelCard:
    return ModelCard(id=state.model_id, created=state.created, max_model_len=state.runner.context_size)


@router.get("/livez", summary="liveness: 200 while the process answers HTTP")
async def livez() -> JSONResponse:
    return JSONResponse({"status": "alive"})


@router.get("/health", summary="readiness: 503 while the model loads or the server drains, 200 when ready")
async def health(request: Request) -> JSONResponse:
    state: ModelState | None = request.app.state.model
    if request.app.state.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    if state is None:
        return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": LOADING_RETRY_AFTER_S})
    failure = state.pool.failure
    if failure is not None:
        return JSONResponse({"status": "unhealthy", "error": failure}, status_code=503)
    runner = state.runner
    return JSONResponse({"status": "ok", "model": state.model_id, "device": str(runner.device),
                         "dtype": str(runner.dtype).removeprefix("torch."), "quant": runner.quant,
                         "deterministic": runner.deterministic,
                         **state.pool.stats()})


@router.get("/metrics", summary="Prometheus metrics, named as vLLM's with the prefix emberserve:")
async def metrics(request: Request) -> Response:
    body, content_type = request.app.state.metrics.exposition()
    return Response(body, media_type=content_type)


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    return ModelList(data=[_card(_state(request))])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def get_model(model_id: str, request: Request) -> ModelCard:
    return _card(_state_for(request, model_id))


@router.post("/v1/chat/completions", response_model=None, responses={200: {"model": ChatCompletionResponse}})
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    _state(request)
    chat: ChatServing = request.app.state.chat
    return await chat.create(body, request)


@router.post("/v1/completions", response_model=None, responses={200: {"model": CompletionResponse}})
async def completions(body: CompletionRequest, request: Request) -> Any:
    _state(request)
    serving: CompletionServing = request.app.state.completions
    return await serving.create(body, request)


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    state = _state_for(request, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise invalid("give exactly one of prompt or messages", param="prompt")
    if body.messages is not None:
        ids = await run_in_threadpool(chat_prompt_ids, state, body.messages, body.add_generation_prompt)
    else:
        ids = await run_in_threadpool(state.runner.tokenizer.encode, body.prompt, body.add_special_tokens)
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=state.runner.context_size)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    state = _state_for(request, body.model)
    check_token_ids(body.tokens, state.runner.vocab_size, "tokens")
    return DetokenizeResponse(prompt=await run_in_threadpool(state.runner.tokenizer.decode, body.tokens))
