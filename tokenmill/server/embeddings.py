"""Embeddings: OpenAI's POST /v1/embeddings and Ollama's POST /api/embed (and its older
/api/embeddings).

Each input (text, or token ids) becomes one engine request that runs its prompt and returns
its pooled vector (pooling.py, SamplingParams.pooling): the inputs of one HTTP request ride
the engine's continuous batching beside everyone else's and keep no KV blocks after. The
server serves them when its engine does (``EngineInfo.pooling``: ``--task embed``, or an
embedding checkpoint); such a server refuses text generation (serving.prepare_all).

``dimensions`` keeps a vector's first N entries and renormalizes them (Matryoshka
truncation); ``encoding_format: "base64"`` sends each vector as little-endian float32 bytes
in base64 (what the openai SDK asks for by default, and decodes). Usage counts prompt tokens.
"""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.outputs import RequestOutput
from tokenmill.pooling import Pooling
from tokenmill.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.server.auth import caller_of
from tokenmill.server.errors import APIError, bad_request
from tokenmill.server.ollama import OllamaServing
from tokenmill.server.serving import OpenAIServing, prepare_all


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: little-endian float32 bytes


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class OllamaEmbedRequest(BaseModel):
    # Unknown top-level fields are ignored, as Ollama's server ignores them.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    input: str | list[str] = Field(default_factory=list)
    truncate: bool = True  # cut an input to the context length (false: a 400 instead)
    dimensions: int | None = Field(default=None, ge=1)
    options: dict[str, Any] | None = None  # the sampler's: nothing to embed
    keep_alive: str | int | float | None = None


class OllamaEmbedResponse(BaseModel):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int = 0
    prompt_eval_count: int


class OllamaEmbeddingsRequest(BaseModel):
    """Ollama's older single-prompt route."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    prompt: str
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


class OllamaEmbeddingsResponse(BaseModel):
    embedding: list[float]


class EmbeddingServing:
    def __init__(self, openai: OpenAIServing, ollama: OllamaServing) -> None:
        self.openai = openai
        self.ollama = ollama
        self.config = openai.config

    async def openai_embeddings(self, body: EmbeddingRequest, raw: Request) -> Response:
        engine = self.openai.state.require_engine()
        self.openai.check_model(body.model)
        inputs = _openai_inputs(body.input)
        outs = await self._embed(engine, inputs, raw, body.user, truncate=False)
        if outs is None:
            return Response(status_code=499)
        data = []
        for i, out in enumerate(outs):
            vector = _shorten(_vector(out), body.dimensions, engine)
            value = _base64(vector) if body.encoding_format == "base64" else vector
            data.append(Embedding(index=i, embedding=value))
        tokens = sum(len(out.prompt_token_ids) for out in outs)
        reply = EmbeddingResponse(
            data=data, model=self.config.served_model_name,
            usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
        )  # fmt: skip
        return JSONResponse(reply.model_dump(mode="json"))

    async def ollama_embed(self, body: OllamaEmbedRequest, raw: Request) -> Response:
        started = time.monotonic_ns()
        engine = self.openai.state.require_engine()
        self.ollama.check_model(body.model)
        inputs: list[str | list[int]] = [body.input] if isinstance(body.input, str) else list(
            body.input)  # fmt: skip
        if not inputs:  # Ollama answers an empty input with no embeddings (a load, by name)
            return JSONResponse(
                OllamaEmbedResponse(
                    model=body.model, embeddings=[], total_duration=0, prompt_eval_count=0
                ).model_dump(mode="json")  # fmt: skip
            )
        outs = await self._embed(engine, inputs, raw, None, truncate=body.truncate)
        if outs is None:
            return Response(status_code=499)
        # Ollama's /api/embed answers unit vectors whatever the model's pooling says.
        vectors = [_unit(_shorten(_vector(out), body.dimensions, engine)) for out in outs]
        reply = OllamaEmbedResponse(
            model=body.model, embeddings=vectors, total_duration=time.monotonic_ns() - started,
            prompt_eval_count=sum(len(out.prompt_token_ids) for out in outs),
        )  # fmt: skip
        return JSONResponse(reply.model_dump(mode="json"))

    async def ollama_embeddings(self, body: OllamaEmbeddingsRequest, raw: Request) -> Response:
        engine = self.openai.state.require_engine()
        self.ollama.check_model(body.model)
        outs = await self._embed(engine, [body.prompt], raw, None, truncate=True)
        if outs is None:
            return Response(status_code=499)
        reply = OllamaEmbeddingsResponse(embedding=_vector(outs[0]))
        return JSONResponse(reply.model_dump(mode="json"))

    async def _embed(
        self,
        engine: AsyncEngine,
        inputs: list[str | list[int]],
        raw: Request,
        user: str | None,
        truncate: bool,
    ) -> list[RequestOutput] | None:
        """Every input's finished output (None: the client went away), each one engine request
        in the same run: keys, limits, metering and metrics as any other."""
        pooling = _pooling(engine)
        if len(inputs) > self.config.max_embedding_inputs:
            raise bad_request(
                f"at most {self.config.max_embedding_inputs} inputs a request "
                f"(--max-embedding-inputs); got {len(inputs)}",
                param="input",
            )
        params = SamplingParams(pooling=pooling, output_kind=RequestOutputKind.FINAL_ONLY)

        def prepare() -> list:
            if truncate:
                limit = engine.info.max_model_len
                cut = [engine.tokenizer.encode(x) if isinstance(x, str) else x for x in inputs]
                return prepare_all(engine, [ids[:limit] for ids in cut], params, {}, "input")
            return prepare_all(engine, inputs, params, {}, "input")

        prepared = await asyncio.to_thread(prepare)
        run = self.openai.start(engine, "embd", prepared, caller=caller_of(raw), user=user)
        return await self.openai.collect(run, raw)


def _pooling(engine: AsyncEngine) -> Pooling:
    pooling = engine.info.pooling
    if pooling is None:
        raise bad_request(
            f"'{engine.info.model}' is served for text generation: start the server with "
            "--task embed (or with an embedding model) to serve embeddings",
            param="model",
            code="unsupported",
        )
    return pooling


def _openai_inputs(value: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(value, str):
        inputs: list[str | list[int]] = [value]
    elif value and isinstance(value[0], int):
        inputs = [list(value)]  # type: ignore[arg-type]
    else:
        inputs = list(value)  # type: ignore[arg-type]
    if not inputs:
        raise bad_request("input must not be empty", param="input")
    for i, x in enumerate(inputs):
        if len(x) == 0:
            raise bad_request(f"input {i} is empty: every input needs a token", param="input")
    return inputs


def _vector(out: RequestOutput) -> list[float]:
    if out.embedding is None:  # the engine failed it (its error is the run's)
        raise APIError(500, out.error or "the engine returned no embedding", code="engine_error")
    return out.embedding


def _shorten(vector: list[float], dimensions: int | None, engine: AsyncEngine) -> list[float]:
    """The first ``dimensions`` entries, renormalized (Matryoshka truncation)."""
    if dimensions is None:
        return vector
    if not 1 <= dimensions <= len(vector):
        raise bad_request(
            f"dimensions must be in [1, {len(vector)}] ({engine.info.model}'s embedding size); "
            f"got {dimensions}",
            param="dimensions",
        )
    return _unit(vector[:dimensions])


def _unit(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / norm for x in vector] if norm > 0 else vector


def _base64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
