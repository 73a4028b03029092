"""Ollama's API (its errors are ``{"error": message}``, errors.error_body_for). The logic is
server/ollama.py's."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenmill import __version__
from tokenmill.server.embeddings import (
    OllamaEmbeddingsRequest,
    OllamaEmbeddingsResponse,
    OllamaEmbedRequest,
    OllamaEmbedResponse,
)
from tokenmill.server.ollama import (
    ChatRequest,
    ChatResponse,
    GenerateRequest,
    GenerateResponse,
    PsResponse,
    ShowRequest,
    ShowResponse,
    TagsResponse,
)
from tokenmill.server.protocol import VersionResponse
from tokenmill.server.routing import NDJSON, App, JSONBodyRoute, example, streams

router = APIRouter(route_class=JSONBodyRoute)


@router.post(
    "/api/chat",
    summary="Ollama chat; NDJSON stream unless stream: false",
    response_model=ChatResponse,
    openapi_extra=example(
        {"model": "{model}", "messages": [{"role": "user", "content": "hi"}],
         "options": {"num_predict": 4}}
    ),
)  # fmt: skip
@streams(ChatResponse, NDJSON)
async def chat(body: ChatRequest, request: Request, app: App) -> Response:
    return await app.ollama.chat(body, request)


@router.post(
    "/api/generate",
    summary="Ollama generate; NDJSON stream unless stream: false",
    response_model=GenerateResponse,
    openapi_extra=example({"model": "{model}", "prompt": "hi", "options": {"num_predict": 4}}),
)
@streams(GenerateResponse, NDJSON)
async def generate(body: GenerateRequest, request: Request, app: App) -> Response:
    return await app.ollama.generate(body, request)


@router.post(
    "/api/embed",
    summary="Ollama embed: unit vectors of texts, when the model serves them (--task embed)",
    response_model=OllamaEmbedResponse,
    openapi_extra=example({"model": "{model}", "input": ["a cat", "a dog"]}),
)
async def embed(body: OllamaEmbedRequest, request: Request, app: App) -> Response:
    return await app.embeddings.ollama_embed(body, request)


@router.post(
    "/api/embeddings",
    summary="Ollama's older embeddings route: one prompt's vector",
    response_model=OllamaEmbeddingsResponse,
    openapi_extra=example({"model": "{model}", "prompt": "a cat"}),
)
async def embeddings(body: OllamaEmbeddingsRequest, request: Request, app: App) -> Response:
    return await app.embeddings.ollama_embeddings(body, request)


@router.get("/api/tags", summary="Ollama: the local models", response_model=TagsResponse)
async def tags(app: App) -> JSONResponse:
    return JSONResponse(app.ollama.tags())


@router.get("/api/ps", summary="Ollama: the loaded models", response_model=PsResponse)
async def ps(app: App) -> JSONResponse:
    return JSONResponse(app.ollama.ps())


@router.post(
    "/api/show",
    summary="Ollama: a model's details",
    response_model=ShowResponse,
    openapi_extra=example({"model": "{model}"}),
)
async def show(body: ShowRequest, app: App) -> JSONResponse:
    return JSONResponse(app.ollama.show(body))


@router.get("/api/version", summary="Ollama: the version", response_model=VersionResponse)
async def version() -> dict[str, str]:
    return {"version": __version__}
