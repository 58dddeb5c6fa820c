"""POST /v1/embeddings: inputs (text or token ids) → one EmbeddingJob on a worker → unit vectors, floats or base64.

Text inputs are tokenized as completions prompts are (with the model's special tokens: BERT's [CLS] ... [SEP]);
token-id inputs are taken as they are, as vLLM takes them. An input longer than the model's context (or
--max-prompt-tokens) is refused with a 400 naming it, as OpenAI does, rather than cut. `dimensions` keeps the first
values of each vector and scales them back to unit length (the Matryoshka convention of OpenAI's text-embedding-3;
a model not trained for it, such as all-MiniLM-L6-v2, loses more of its quality that way).
"""
from __future__ import annotations

import asyncio
import base64
import logging
import time

import torch
import torch.nn.functional as F
from fastapi import Request
from fastapi.responses import Response

from engine.errors import CONTEXT_LENGTH_EXCEEDED

from server.scheduling.embedding_jobs import EmbeddingJob, EmbeddingsDone
from server.errors import APIError, invalid
from server.scheduling.generation import GenerationFailed
from server.api.metrics import ServerMetrics
from server.api.openai.protocol import (MAX_EMBEDDING_INPUTS, EmbeddingData, EmbeddingRequest, EmbeddingResponse,
    EmbeddingUsage)
from server.logs import current_request
from server.api.openai.serving import DISCONNECT_POLL_S, check_model, check_token_ids, prompt_work, request_id
from server.scheduling.model_state import ModelState

log = logging.getLogger("emberserve.serving")


def encode_vector(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    """One embedding as the API sends it: a list of floats, or base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4", copy=False).tobytes()).decode("ascii")
    return vector.tolist()


class EmbeddingServing:
    """Embeddings of the served model (an encoder, or a decoder started with --embeddings)."""

    def __init__(self, state: ModelState, metrics: ServerMetrics) -> None:
        self.state, self.metrics = state, metrics
        self.model = state.model
        self.tokenizer = state.model.tokenizer

    async def create(self, req: EmbeddingRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        record = current_request()
        if record is not None:
            record.model = req.model
        check_model(self.state, req.model)
        if not self.state.embeddings:
            raise invalid(f"`{req.model}` is served for generation only: start the server with --embeddings to "
                          "embed with it, or serve an embedding model (all-minilm-l6-v2)", param="model",
                          code="embeddings_not_enabled")
        if req.model_extra:
            log.info("ignoring unknown request fields: %s", ", ".join(sorted(req.model_extra)))
        size = self.model.embedding_size
        if req.dimensions is not None and req.dimensions > size:
            raise invalid(f"dimensions must be at most {size} for this model, got {req.dimensions}",
                          param="dimensions")
        inputs = await prompt_work(self._inputs, req)
        job = EmbeddingJob(inputs, self.state.pooling, request_id("embd"), arrival)
        self.state.pool.submit(job)
        done = await self._result(job, request)
        vectors = done.embeddings
        if req.dimensions is not None and req.dimensions < size:
            vectors = F.normalize(vectors[:, :req.dimensions], p=2.0, dim=1)
        self.metrics.prompt_tokens.inc(done.prompt_tokens)
        if record is not None:
            record.prompt_tokens += done.prompt_tokens
        body = EmbeddingResponse(
            data=[EmbeddingData(index=i, embedding=encode_vector(v, req.encoding_format)) for i, v in
                  enumerate(vectors)],
            model=req.model, usage=EmbeddingUsage(prompt_tokens=done.prompt_tokens, total_tokens=done.prompt_tokens))
        return Response(body.model_dump_json(), media_type="application/json")

    def _inputs(self, req: EmbeddingRequest) -> list[list[int]]:
        """Every input's token ids, checked: none empty, in the vocabulary, within the length limit."""
        raw = req.input
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            raw = [raw]
        if not raw:
            raise invalid("input must not be empty: give a string, a list of strings, token ids or lists of token "
                          "ids", param="input")
        # Checked before tokenizing anything.
        if len(raw) > MAX_EMBEDDING_INPUTS:
            raise invalid(f"input is a list of {len(raw)} inputs; at most {MAX_EMBEDDING_INPUTS} are allowed per "
                          "request", param="input", code="too_many_inputs")
        limit = self.model.context_size
        if self.state.max_prompt_tokens is not None:
            limit = min(limit, self.state.max_prompt_tokens)
        inputs = []
        for i, item in enumerate(raw):
            if isinstance(item, str):
                if not item:
                    raise invalid(f"input[{i}] is an empty string", param="input")
                ids = self.tokenizer.encode(item)
                if not ids:  # only characters the tokenizer drops (control characters, for some models)
                    raise invalid(f"input[{i}] has no tokens: nothing in it is kept by this model's tokenizer",
                                  param="input")
            else:
                if not item:
                    raise invalid(f"input[{i}] is an empty list of token ids", param="input")
                check_token_ids(item, self.model.vocab_size, "input")
                ids = list(item)
            if len(ids) > limit:
                raise invalid(f"input[{i}] has {len(ids)} tokens; this model takes at most {limit} tokens per input",
                              param="input", code=CONTEXT_LENGTH_EXCEEDED)
            inputs.append(ids)
        return inputs

    async def _result(self, job: EmbeddingJob, request: Request) -> EmbeddingsDone:
        """The job's vectors once the worker sends them; a client that goes away cancels it."""
        try:
            while True:
                try:
                    _, event = await asyncio.wait_for(job.channel.get(), DISCONNECT_POLL_S)
                except TimeoutError:
                    if await request.is_disconnected():
                        log.info("client went away: cancelling %s", job.request_id)
                        raise APIError(499, "client closed request") from None
                    continue
                if isinstance(event, GenerationFailed):
                    raise APIError(event.status, event.message, code=event.code,
                                   type="server_error" if event.status >= 500 else None)
                return event
        finally:
            job.cancel()
