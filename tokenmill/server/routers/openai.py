"""OpenAI's API: completions and chat (JSON, or SSE with ``stream: true``), models, and
vLLM's tokenize / detokenize helpers. The logic is server/serving.py's."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.server.embeddings import EmbeddingRequest, EmbeddingResponse
from tokenmill.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from tokenmill.server.routing import App, JSONBodyRoute, example, streams

router = APIRouter(route_class=JSONBodyRoute)


@router.post(
    "/v1/completions",
    summary="Text completion (OpenAI); streamed as SSE with stream: true",
    response_model=CompletionResponse,
    openapi_extra=example(
        {"prompt": "Once upon a time", "max_tokens": 4, "stream": True,
         "stream_options": {"include_usage": True}, "logprobs": 1}
    ),
)  # fmt: skip
@streams(CompletionChunk)
async def completions(body: CompletionRequest, request: Request, app: App) -> Response:
    return await app.openai.completions(body, request)


@router.post(
    "/v1/chat/completions",
    summary="Chat completion (OpenAI); streamed as SSE with stream: true",
    response_model=ChatCompletionResponse,
    openapi_extra=example(
        {"messages": [{"role": "user", "content": "Name three colours."}],
         "max_tokens": 4, "stream": True, "logprobs": True, "top_logprobs": 2}
    ),
)  # fmt: skip
@streams(ChatCompletionChunk)
async def chat_completions(body: ChatCompletionRequest, request: Request, app: App) -> Response:
    return await app.openai.chat(body, request)


@router.post(
    "/v1/embeddings",
    summary="Embeddings (OpenAI) of texts or token ids, when the model serves them (--task embed)",
    response_model=EmbeddingResponse,
    openapi_extra=example({"model": "{model}", "input": ["a cat", "a dog"]}),
)
async def embeddings(body: EmbeddingRequest, request: Request, app: App) -> Response:
    return await app.embeddings.openai_embeddings(body, request)


@router.get("/v1/models", summary="The served model", response_model=ModelList)
async def list_models(app: App) -> JSONResponse:
    return JSONResponse(app.openai.models().model_dump(mode="json"))


@router.get("/v1/models/{model_id:path}", summary="One model by name", response_model=ModelCard)
async def get_model(model_id: Annotated[str, Path(examples=["{model}"])], app: App) -> JSONResponse:
    return JSONResponse(app.openai.model(model_id).model_dump(mode="json"))


@router.post(
    "/tokenize",
    summary="Token ids of a prompt or chat",
    response_model=TokenizeResponse,
    openapi_extra=example({"messages": [{"role": "user", "content": "hi"}]}),
)
async def tokenize(body: TokenizeRequest, app: App) -> JSONResponse:
    return JSONResponse((await app.openai.tokenize(body)).model_dump(mode="json"))


@router.get(
    "/tokenizer_info",
    summary="The tokenizer's settings (vLLM's; beside /tokenize and /detokenize)",
    response_model=TokenizerInfo,
)
async def tokenizer_info(app: App) -> JSONResponse:
    return JSONResponse(app.openai.tokenizer_info().model_dump(mode="json"))


@router.post(
    "/detokenize",
    summary="Text of token ids",
    response_model=DetokenizeResponse,
    openapi_extra=example({"tokens": [40, 41]}),
)
async def detokenize(body: DetokenizeRequest, app: App) -> JSONResponse:
    return JSONResponse((await app.openai.detokenize(body)).model_dump(mode="json"))
