"""The router's HTTP app: the OpenAI and Ollama routes proxied, /health and /metrics.

POST /v1/completions, /v1/chat/completions, /api/generate, /api/chat
                    routed by prompt prefix (policy.py), streamed through (proxy.py)
GET  /v1/models, /v1/models/{id}, /api/tags, /api/ps, /api/version, /v1/usage;
     POST /api/show, /tokenize, /detokenize   sent to the least-loaded healthy replica
POST /reset_prefix_cache                      sent to every healthy replica
POST /abort_request                           sent to every healthy replica; the one that
                                              holds the request answers
GET  /health        200 while a replica is up (503 when none), each replica's state
GET  /metrics       the router's own (metrics.py); replicas keep theirs
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
from collections.abc import AsyncIterator

import httpx
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.router.config import RouterConfig
from tokenmill.router.health import check_all, health_loop
from tokenmill.router.metrics import create_registry, render
from tokenmill.router.proxy import Proxy, error_response
from tokenmill.router.replicas import ReplicaSet

ROUTED = ("/v1/completions", "/v1/chat/completions", "/api/generate", "/api/chat")
READ_GET = ("/v1/models", "/v1/models/{model_id:path}", "/api/tags", "/api/ps", "/api/version")
READ_POST = ("/api/show", "/tokenize", "/detokenize")
# Every replica keeps its own; with --usage-db the replicas share one file, so any answers.
READ_GET += ("/v1/usage",)
BROADCAST = ("/reset_prefix_cache",)
ANY_REPLICA = ("/abort_request",)  # one replica holds the request: its answer is the answer
# NOTE: the connect timeout is what a dead host costs a request before its retry; reads
# have none (a non-streamed completion sends nothing until it is done).
CONNECT_TIMEOUT_S = 5.0


def create_app(config: RouterConfig, replicas: ReplicaSet | None = None) -> Starlette:
    """The router app; ``replicas`` may be shared with a launcher that watches processes."""
    replicas = replicas or ReplicaSet.from_urls(list(config.replica_urls))
    registry = create_registry(replicas)
    proxy: Proxy | None = None

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        nonlocal proxy
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        timeout = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            proxy = Proxy(client, replicas, config.max_body_bytes)
            await check_all(client, replicas)
            task = asyncio.create_task(health_loop(client, replicas, config.health_interval))
            try:
                yield
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def routed(request: Request) -> Response:
        assert proxy is not None
        return await proxy.forward(request, routed=True)

    async def read_only(request: Request) -> Response:
        assert proxy is not None
        return await proxy.forward(request, routed=False)

    async def broadcast(request: Request) -> Response:
        assert proxy is not None
        return await proxy.broadcast(request, any_replica=request.url.path in ANY_REPLICA)

    async def health(_: Request) -> JSONResponse:
        up = replicas.num_healthy > 0
        body = {"status": "ok" if up else "no_healthy_replica", "replicas": replicas.status()}
        return JSONResponse(body, status_code=200 if up else 503)

    async def metrics(_: Request) -> Response:
        return Response(render(registry), media_type=CONTENT_TYPE_LATEST)

    routes = [
        Route("/health", health),
        Route("/metrics", metrics),
        *(Route(p, routed, methods=["POST"]) for p in ROUTED),
        *(Route(p, read_only, methods=["GET"]) for p in READ_GET),
        *(Route(p, read_only, methods=["POST"]) for p in READ_POST),
        *(Route(p, broadcast, methods=["POST"]) for p in (*BROADCAST, *ANY_REPLICA)),
    ]
    app = Starlette(
        routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error}
    )
    app.state.replicas = replicas
    if config.api_keys:
        public = ("/health", *(("/metrics",) if config.metrics_public else ()))
        app.add_middleware(_KeyCheck, api_keys=config.api_keys, public_paths=public)
    return app


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's 404 and 405 in the API's error shape (the router's and the host's)."""
    assert isinstance(exc, HTTPException)
    path = request.url.path
    if exc.status_code == 405:
        message = f"method {request.method} is not allowed on {path}"
        return error_response(path, 405, message, "method_not_allowed")
    return error_response(path, exc.status_code, f"no route {request.method} {path}",
                          "not_found")  # fmt: skip


class _KeyCheck:
    """401 unless the request bears one of the router's keys (``public_paths`` are open)."""

    def __init__(
        self, app: ASGIApp, api_keys: tuple[str, ...], public_paths: tuple[str, ...]
    ) -> None:
        self.app = app
        self._digests = [hashlib.sha256(k.encode()).digest() for k in api_keys]
        self._public = public_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._public or self._is_authorized(scope):
            await self.app(scope, receive, send)
            return
        message = "missing or invalid API key: send it as 'Authorization: Bearer <key>' or " \
            "'X-Api-Key: <key>'"  # fmt: skip
        response = error_response(scope["path"], 401, message, "invalid_api_key")
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)

    def _is_authorized(self, scope: Scope) -> bool:
        presented = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.strip().partition(b" ")
                if scheme.lower() == b"bearer":
                    presented = token.strip()
            elif name == b"x-api-key":
                presented = value.strip()
        if not presented:
            return False
        digest = hashlib.sha256(presented).digest()
        matched = False
        for expected in self._digests:  # no early exit: every key is compared
            matched |= hmac.compare_digest(digest, expected)
        return matched
