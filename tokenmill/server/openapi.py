"""The OpenAPI document of the app (GET /openapi.json), built from its routes (server/routers/):
every route with its request and response bodies as the protocol models describe them, so
generated clients and fuzzers work.

FastAPI lays out the paths, parameters, summaries and examples from each route's declaration.
The bodies are put in here from the same declarations (the handler's typed body parameter, its
``response_model``, its ``streams`` mark), because the server's strict models need two
schemas each: requests in pydantic's validation mode, responses in its serialization mode,
under the models' own names. Errors are the bodies the server sends (Ollama's on /api/), not
FastAPI's 422. tests/server/test_openapi.py checks every route against the served document.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from tokenmill.server.anthropic import AnthropicErrorResponse
from tokenmill.server.errors import ANTHROPIC_PREFIX, OLLAMA_PREFIX
from tokenmill.server.ollama import OllamaErrorResponse
from tokenmill.server.protocol import ErrorResponse, HealthResponse
from tokenmill.server.routing import PUBLIC, SSE

_ERRORS = {
    "4XX": "a bad request (400, 413), key (401), permission (403), route or model (404), "
    "or too many requests (429, with Retry-After)",
    "5XX": "the model is loading or the server shutting down (503), or an engine failure (500)",
}
# Stands for the served model's name in the routes' examples.
MODEL_PLACEHOLDER = "{model}"


def api_routes(app: FastAPI) -> list[APIRoute]:
    return [r for r in app.routes if isinstance(r, APIRoute) and r.include_in_schema]


def is_public(route: APIRoute) -> bool:
    """Needs no API key (routing.PUBLIC)."""
    return (route.openapi_extra or {}).get("security") == PUBLIC["security"]


def openapi_schema(
    app: FastAPI, has_keys: bool, metrics_public: bool = False, model_name: str = "model"
) -> dict[str, Any]:
    """The document for ``app``; ``has_keys``: the routes but the public ones need a key;
    ``metrics_public``: /metrics needs no key (``--metrics-public``); ``model_name``: the
    served model, in the examples."""
    routes = api_routes(app)
    schema = get_openapi(
        title=app.title,
        version=app.version,
        description="tokenmill: an OpenAI-compatible (and Ollama-compatible) LLM server.",
        routes=routes,
    )
    inputs = {m for r in routes if (m := _request_model(r)) is not None}
    outputs = {m for r in routes for m in (_response_model(r), _stream(r)[0]) if m is not None}
    outputs |= {ErrorResponse, OllamaErrorResponse, AnthropicErrorResponse}
    keys = [(m, "validation") for m in sorted(inputs, key=_name)]
    keys += [(m, "serialization") for m in sorted(outputs, key=_name)]
    refs, defs = models_json_schema(keys, ref_template="#/components/schemas/{model}")
    schema["components"] = {
        "schemas": dict(sorted(defs.get("$defs", {}).items())),
        "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "X-Api-Key"},
        },
    }
    for route in routes:
        for method in route.methods:
            op = schema["paths"][route.path_format][method.lower()]
            op.pop("description", None)
            request = _request_model(route)
            if request is not None:
                content = op["requestBody"]["content"]["application/json"]
                content["schema"] = refs[(request, "validation")]
            op["responses"] = _responses(route, op["responses"]["200"], refs)
            if has_keys:
                public = is_public(route) or (metrics_public and route.path == "/metrics")
                op["security"] = [] if public else [{"bearer": []}, {"apiKey": []}]
    return _with_model_name(schema, model_name)


def _request_model(route: APIRoute) -> type[BaseModel] | None:
    if route.body_field is None:
        return None
    model: type[BaseModel] = route.body_field.field_info.annotation  # type: ignore[assignment]
    return model


def _response_model(route: APIRoute) -> type[BaseModel] | None:
    model = route.response_model
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _stream(route: APIRoute) -> tuple[type[BaseModel] | None, str]:
    """The item of a streamed answer, and the stream's media type (routing.streams)."""
    return getattr(route.endpoint, "stream_item", (None, SSE))


def _responses(route: APIRoute, ok: dict[str, Any], refs: dict[Any, Any]) -> dict[str, Any]:
    content: dict[str, Any] = {}
    response = _response_model(route)
    if response is not None:
        content["application/json"] = {"schema": refs[(response, "serialization")]}
    else:  # a body that is not a model: what FastAPI made of the response class
        content = ok.get("content", {})
    item, media_type = _stream(route)
    if item is not None:
        content[media_type] = _stream_content(refs[(item, "serialization")], media_type)
    error: type[BaseModel] = ErrorResponse
    if route.path.startswith(OLLAMA_PREFIX):
        error = OllamaErrorResponse
    elif route.path.startswith(ANTHROPIC_PREFIX):
        error = AnthropicErrorResponse
    error_content = {"application/json": {"schema": refs[(error, "serialization")]}}
    responses: dict[str, Any] = {"200": {"description": "OK", "content": content}}
    for status, description in _ERRORS.items():
        responses[status] = {"description": description, "content": error_content}
    if response is HealthResponse:  # /health's 503 says why in its own shape
        responses["5XX"] = {"description": "not ready", "content": content}
    return responses


def _stream_content(item: dict[str, Any], media_type: str) -> dict[str, Any]:
    # Each event (SSE: a "data: " line; NDJSON: a line) holds one item object (x-item-schema).
    # An SSE stream's "schema" is one event, as OpenAPI 3.1 tools read it (schemathesis
    # validates each event against it): its data is a chunk's JSON text, or [DONE] at the end.
    if media_type != SSE:
        return {"schema": {"type": "string"}, "x-item-schema": item}
    event = {
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
    return {"schema": event, "x-item-schema": item}


def _with_model_name(node: Any, model_name: str) -> Any:
    if node == MODEL_PLACEHOLDER:
        return model_name
    if isinstance(node, dict):
        return {k: _with_model_name(v, model_name) for k, v in node.items()}
    if isinstance(node, list):
        return [_with_model_name(v, model_name) for v in node]
    return node


def _name(model: type[BaseModel]) -> str:
    return f"{model.__module__}.{model.__qualname__}"
