"""The OpenAPI document of the app (GET /openapi.json): every route with its request and
response bodies as the protocol models describe them, so generated clients and fuzzers work.

The handlers read their bodies themselves (api.py: size cap, strict parsing, 400s), so FastAPI
does not see the models; ``ROUTES`` names them for each route instead, and
``openapi_schema`` puts them into the document: request bodies in pydantic's validation mode,
responses in its serialization mode, errors as the error bodies the server sends (Ollama's
on /api/). A route missing from ``ROUTES`` is an error when the document is built, and
tests/server/test_openapi.py checks every route against the served document.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from tokenmill.server import ollama
from tokenmill.server.protocol import (
    AbortRequest,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    LiveStats,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UsageReport,
)

SSE = "text/event-stream"
NDJSON = "application/x-ndjson"


class HealthResponse(BaseModel):
    status: str  # ok; loading, stopping, failed, engine_failed (503)
    error: str | None = None  # why the model failed to load


class VersionResponse(BaseModel):
    version: str


class ResetPrefixCacheResponse(BaseModel):
    reset: bool


class AbortResponse(BaseModel):
    aborted: list[str]  # the engine requests stopped (one per prompt of the request)


@dataclass(frozen=True)
class RouteDoc:
    """What one route takes and answers."""

    summary: str
    request: type[BaseModel] | None = None
    response: type[BaseModel] | None = None  # application/json
    stream: type[BaseModel] | None = None  # each event of a streamed answer
    stream_media_type: str = SSE
    media_type: str | None = None  # a body that is not JSON (text/plain, text/html)
    parameters: list[dict[str, Any]] = field(default_factory=list)
    public: bool = False  # no API key needed
    ollama: bool = False  # Ollama's error body
    example: dict[str, Any] | None = None  # a valid request body (fuzzers start from it)


def _query(name: str, description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "description": description,
            "schema": {"type": "string"}}  # fmt: skip


USAGE_PARAMETERS = [
    _query("key", "an API key whose usage to report (admin; a user key may name only itself)"),
    _query("key_id", "the same by key id (8 hex digits, as reports show)"),
    _query("user", "only requests that sent this 'user'"),
    _query("since", "from this time on: unix seconds or ISO 8601 (2026-01-31, ...T12:00:00Z)"),
    _query("until", "before this time (same forms)"),
    {"name": "group_by", "in": "query", "required": False,
     "description": "one row per day (UTC), key, model or user",
     "schema": {"type": "string", "enum": ["day", "key", "model", "user"]}},
]  # fmt: skip

ROUTES: dict[tuple[str, str], RouteDoc] = {
    ("POST", "/v1/completions"): RouteDoc(
        "Text completion (OpenAI); streamed as SSE with stream: true",
        CompletionRequest, CompletionResponse, CompletionChunk,
        example={"prompt": "Once upon a time", "max_tokens": 4, "stream": True,
                 "stream_options": {"include_usage": True}, "logprobs": 1},
    ),
    ("POST", "/v1/chat/completions"): RouteDoc(
        "Chat completion (OpenAI); streamed as SSE with stream: true",
        ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk,
        example={"messages": [{"role": "user", "content": "Name three colours."}],
                 "max_tokens": 4, "stream": True, "logprobs": True, "top_logprobs": 2},
    ),
    ("GET", "/v1/models"): RouteDoc("The served model", response=ModelList),
    ("GET", "/v1/models/{model_id}"): RouteDoc("One model by name", response=ModelCard),
    ("POST", "/tokenize"): RouteDoc("Token ids of a prompt or chat", TokenizeRequest,
                                    TokenizeResponse,
                                    example={"messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/detokenize"): RouteDoc("Text of token ids", DetokenizeRequest,
                                      DetokenizeResponse, example={"tokens": [40, 41]}),
    ("POST", "/reset_prefix_cache"): RouteDoc(
        "Forget cached prefix blocks (needs keys; the admin key when there is one)",
        response=ResetPrefixCacheResponse,
    ),
    ("POST", "/abort_request"): RouteDoc(
        "Abort an unfinished request by its id (needs keys; the admin key when there is one)",
        AbortRequest, AbortResponse, example={"request_id": "cmpl-0123"},
    ),
    ("GET", "/health"): RouteDoc("200 when ready, else 503 (no key needed)",
                                 response=HealthResponse, public=True),
    ("GET", "/version"): RouteDoc("tokenmill's version", response=VersionResponse),
    ("GET", "/metrics"): RouteDoc("Prometheus metrics", media_type="text/plain"),
    ("GET", "/v1/usage"): RouteDoc(
        "Metered usage and cost: any key's for the admin key, its own for a user key",
        response=UsageReport, parameters=USAGE_PARAMETERS,
    ),
    ("GET", "/v1/stats"): RouteDoc("Live figures over a sliding window (the dashboard's data)",
                                   response=LiveStats),
    ("GET", "/dashboard"): RouteDoc("The live dashboard page (no key needed: it asks)",
                                    media_type="text/html", public=True),
    ("GET", "/docs"): RouteDoc("This document, readable (no key needed: it asks)",
                               media_type="text/html", public=True),
    ("GET", "/static/{name}"): RouteDoc("The pages' scripts", media_type="text/javascript",
                                        public=True),
    ("GET", "/openapi.json"): RouteDoc("This OpenAPI document", media_type="application/json"),
    ("POST", "/api/chat"): RouteDoc(
        "Ollama chat; NDJSON stream unless stream: false", ollama.ChatRequest,
        ollama.ChatResponse, ollama.ChatResponse, NDJSON, ollama=True,
        example={"model": "{model}", "messages": [{"role": "user", "content": "hi"}],
                 "options": {"num_predict": 4}},
    ),
    ("POST", "/api/generate"): RouteDoc(
        "Ollama generate; NDJSON stream unless stream: false", ollama.GenerateRequest,
        ollama.GenerateResponse, ollama.GenerateResponse, NDJSON, ollama=True,
        example={"model": "{model}", "prompt": "hi", "options": {"num_predict": 4}},
    ),
    ("GET", "/api/tags"): RouteDoc("Ollama: the local models", response=ollama.TagsResponse,
                                   ollama=True),
    ("GET", "/api/ps"): RouteDoc("Ollama: the loaded models", response=ollama.PsResponse,
                                 ollama=True),
    ("POST", "/api/show"): RouteDoc("Ollama: a model's details", ollama.ShowRequest,
                                    ollama.ShowResponse, ollama=True,
                                    example={"model": "{model}"}),
    ("GET", "/api/version"): RouteDoc("Ollama: the version", response=VersionResponse,
                                      ollama=True),
}  # fmt: skip

_ERRORS = {
    "4XX": "a bad request (400, 413), key (401), permission (403), route or model (404), "
    "or too many requests (429, with Retry-After)",
    "5XX": "the model is loading or the server shutting down (503), or an engine failure (500)",
}


def openapi_schema(
    app: FastAPI,
    has_keys: bool,
    static_names: tuple[str, ...] = (),
    metrics_public: bool = False,
    model_name: str = "model",
) -> dict[str, Any]:
    """The document for ``app``; ``has_keys``: the routes but the public ones need a key;
    ``static_names``: the files /static/{name} serves; ``metrics_public``: /metrics needs
    no key (``--metrics-public``); ``model_name``: the served model, in the examples."""
    routes = [r for r in app.routes if isinstance(r, APIRoute) and r.include_in_schema]
    docs = []
    for route in routes:
        for method in sorted(route.methods):
            key = (method, route.path_format)
            if key not in ROUTES:
                raise KeyError(f"{method} {route.path_format} has no entry in openapi.ROUTES")
            docs.append((key, ROUTES[key]))
    schema = get_openapi(
        title=app.title,
        version=app.version,
        description="tokenmill: an OpenAI-compatible (and Ollama-compatible) LLM server.",
        routes=routes,
    )
    inputs = {d.request for _, d in docs if d.request is not None}
    outputs = {m for _, d in docs for m in (d.response, d.stream) if m is not None}
    outputs |= {ErrorResponse, ollama.OllamaErrorResponse}
    keys = [(m, "validation") for m in sorted(inputs, key=_name)]
    keys += [(m, "serialization") for m in sorted(outputs, key=_name)]
    refs, defs = models_json_schema(keys, ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {})
    components["schemas"] = dict(sorted(defs.get("$defs", {}).items()))
    components["securitySchemes"] = {
        "bearer": {"type": "http", "scheme": "bearer"},
        "apiKey": {"type": "apiKey", "in": "header", "name": "X-Api-Key"},
    }
    for (method, path), doc in docs:
        op = schema["paths"][path][method.lower()]
        op["summary"] = doc.summary
        op.pop("description", None)
        if doc.parameters:
            op["parameters"] = [*op.get("parameters", []), *doc.parameters]
        for param in op.get("parameters", []):
            if path == "/static/{name}" and param["name"] == "name":
                param["schema"] = {"type": "string", "enum": list(static_names)}
            if path == "/v1/models/{model_id}" and param["name"] == "model_id":
                param["example"] = model_name
        if doc.request is not None:
            body: dict[str, Any] = {"schema": refs[(doc.request, "validation")]}
            if doc.example is not None:
                body["example"] = {
                    k: model_name if v == "{model}" else v for k, v in doc.example.items()
                }
            op["requestBody"] = {"required": True, "content": {"application/json": body}}
        op["responses"] = _responses(doc, refs)
        if has_keys:
            public = doc.public or (metrics_public and path == "/metrics")
            op["security"] = [] if public else [{"bearer": []}, {"apiKey": []}]
    return schema


def _responses(doc: RouteDoc, refs: dict[Any, Any]) -> dict[str, Any]:
    content: dict[str, Any] = {}
    if doc.response is not None:
        content["application/json"] = {"schema": refs[(doc.response, "serialization")]}
    if doc.stream is not None:
        # Each event (SSE: a "data: " line; NDJSON: a line) holds one of these objects
        # (x-item-schema). An SSE stream's "schema" is one event, as OpenAPI 3.1 tools read it
        # (schemathesis validates each event against it): its data is a chunk's JSON text, or
        # [DONE] at the end.
        item = refs[(doc.stream, "serialization")]
        if doc.stream_media_type == SSE:
            stream_schema: dict[str, Any] = {
                "type": "object",
                "required": ["data"],
                "properties": {
                    "data": {"anyOf": [
                        {"type": "string", "contentMediaType": "application/json",
                         "contentSchema": item},
                        {"const": "[DONE]"},
                    ]},
                    "event": {"type": "string"},
                    "id": {"type": "string"},
                    "retry": {"type": "integer"},
                },
            }  # fmt: skip
        else:
            stream_schema = {"type": "string"}
        content[doc.stream_media_type] = {"schema": stream_schema, "x-item-schema": item}
    if doc.media_type is not None:
        kind = {"type": "object"} if doc.media_type == "application/json" else {"type": "string"}
        content[doc.media_type] = {"schema": kind}
    error = ollama.OllamaErrorResponse if doc.ollama else ErrorResponse
    error_content = {"application/json": {"schema": refs[(error, "serialization")]}}
    responses: dict[str, Any] = {"200": {"description": "OK", "content": content}}
    for status, description in _ERRORS.items():
        responses[status] = {"description": description, "content": error_content}
    if doc.response is HealthResponse:  # /health's 503 says why in its own shape
        responses["5XX"] = {"description": "not ready", "content": content}
    return responses


def _name(model: type[BaseModel]) -> str:
    return f"{model.__module__}.{model.__qualname__}"
