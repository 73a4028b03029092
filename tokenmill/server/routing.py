"""What every router shares: the app's services, the JSON-body route class, and the marks the
OpenAPI document reads off a route (server/openapi.py).

A handler declares its body as a typed parameter (``body: CompletionRequest``), as FastAPI
handlers do, and FastAPI describes it in /openapi.json. ``JSONBodyRoute`` reads that body
before FastAPI would, because the server's rules for a body differ from FastAPI's:

- a request the server cannot serve (loading, shutting down) gets its 503 before its body is
  read;
- at most ``max_body_bytes`` are read, whether or not the client sent a Content-Length (413);
- the body is parsed as JSON whatever its Content-Type (``curl -d`` sends a form type), and
  strictly in pydantic's JSON mode (``"2"`` is not 2, NaN is refused), with a 400 naming the
  field in the OpenAI shape (Ollama's on /api/) instead of FastAPI's 422.

FastAPI's handler then receives the parsed model as the request's JSON, and validating a model
instance against its own class returns it as it is: the body is parsed once.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import Response

from tokenmill.server.anthropic import AnthropicServing
from tokenmill.server.config import ServerConfig
from tokenmill.server.embeddings import EmbeddingServing
from tokenmill.server.errors import APIError, from_validation_error
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.ollama import OllamaServing
from tokenmill.server.responses import ResponsesServing
from tokenmill.server.serving import OpenAIServing
from tokenmill.server.state import ServerState
from tokenmill.server.usage import UsageMeter

M = TypeVar("M", bound=BaseModel)
E = TypeVar("E", bound=Callable[..., Any])

SSE = "text/event-stream"
NDJSON = "application/x-ndjson"


@dataclass(frozen=True)
class Services:
    """What the handlers work with, one set per app (``app.state.services``)."""

    config: ServerConfig
    state: ServerState
    metrics: ServerMetrics
    meter: UsageMeter
    openai: OpenAIServing
    ollama: OllamaServing
    anthropic: AnthropicServing
    responses: ResponsesServing
    embeddings: EmbeddingServing


def services_of(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


# A handler parameter that receives the app's services.
App = Annotated[Services, Depends(services_of)]


class JSONBodyRoute(APIRoute):
    """A route whose typed body parameter is read by the server's rules (module docstring)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()
        if self.body_field is None:
            return handle
        model: type[BaseModel] = self.body_field.field_info.annotation  # type: ignore[assignment]

        async def read_body_first(request: Request) -> Response:
            services = services_of(request)
            services.state.require_engine()  # 503 before reading a body that cannot be served
            raw = await read_capped(request, services.config.max_body_bytes)
            return await handle(_ParsedRequest(request, raw, parse_strict(raw, model)))

        return read_body_first


class _ParsedRequest(Request):
    """The request as FastAPI's handler sees it once its body is read and parsed."""

    def __init__(self, request: Request, raw: bytes, parsed: BaseModel) -> None:
        super().__init__(request.scope, request.receive)
        self._raw = raw
        self._parsed = parsed

    async def body(self) -> bytes:
        return self._raw

    async def json(self) -> Any:
        return self._parsed

    @property
    def headers(self) -> Headers:
        # FastAPI hands the handler a JSON body only under a JSON Content-Type; this body was
        # parsed as JSON whatever the client called it.
        headers = MutableHeaders(scope=dict(self.scope, headers=list(self.scope["headers"])))
        headers["content-type"] = "application/json"
        return headers


async def read_capped(request: Request, max_bytes: int) -> bytes:
    """At most ``max_bytes`` of the body: 413 beyond, told by Content-Length or found reading."""
    too_large = APIError(
        413,
        f"the request body is larger than the limit of {max_bytes} bytes",
        code="request_too_large",
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        parts.append(chunk)
    return b"".join(parts)


def parse_strict(raw: bytes, model: type[M]) -> M:
    """``raw`` as a ``model``, in pydantic's JSON mode: 400 naming the field at fault."""
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_type")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise from_validation_error(e) from None


# ---- marks for the OpenAPI document ---------------------------------------------------------

# An operation without security needs no API key: the key middleware lets it through (auth.py)
# and the document says so.
PUBLIC: dict[str, Any] = {"security": []}


def streams(item: type[BaseModel], media_type: str = SSE) -> Callable[[E], E]:
    """Marks a handler that answers a stream of ``item`` objects when the request asks for one
    (``stream: true``): SSE events, or NDJSON lines."""

    def mark(endpoint: E) -> E:
        endpoint.stream_item = (item, media_type)  # type: ignore[attr-defined]
        return endpoint

    return mark


def example(body: dict[str, Any]) -> dict[str, Any]:
    """``openapi_extra`` giving a valid request body (fuzzers start from it); ``"{model}"``
    stands for the served model's name."""
    return {"requestBody": {"content": {"application/json": {"example": body}}}}
