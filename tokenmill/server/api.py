"""The FastAPI app: routes, body limits, lifespan (background model load, stats log, drain).

Routes:
    POST /v1/completions, POST /v1/chat/completions      OpenAI, streamed (SSE) or not
    GET  /v1/models, GET /v1/models/{model}
    POST /tokenize, POST /detokenize                      vLLM-compatible helpers
    POST /reset_prefix_cache   admin (only with --api-key): forget cached prefix blocks
    POST /abort_request        admin (only with --api-key): stop an unfinished request by id
    GET  /v1/usage      metered usage per key / user / model / day (server/usage.py)
    GET  /v1/stats      live figures over a sliding window (server/stats.py)
    GET  /dashboard     a page that charts /v1/stats (static/dashboard.html, no key needed:
                        it holds no data and asks for the key itself)
    GET  /openapi.json  every route's bodies (server/openapi.py); GET /docs reads it
    GET  /health        200 ready; 503 loading, shutting down, or failed (no API key needed)
    GET  /metrics       Prometheus text format (no API key needed with --metrics-public)
    GET  /version
    POST /api/chat, POST /api/generate, GET /api/tags, GET /api/ps, POST /api/show,
    GET  /api/version                                      Ollama's API (server/ollama.py)

Bodies are read here, capped at ``max_body_bytes`` (413), and parsed strictly by the protocol
models (400 naming the field); FastAPI's own body parsing (422) is not used.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import logging
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.outputs import EngineStats
from tokenmill.server.auth import EXEMPT_PATHS, APIKeyMiddleware, caller_of
from tokenmill.server.config import ServerConfig
from tokenmill.server.errors import APIError, from_validation_error, install_error_handlers
from tokenmill.server.limits import RateLimiter
from tokenmill.server.metrics import ServerMetrics, log_stats_periodically
from tokenmill.server.ollama import ChatRequest, GenerateRequest, OllamaServing, ShowRequest
from tokenmill.server.openapi import openapi_schema
from tokenmill.server.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tokenmill.server.serving import OpenAIServing
from tokenmill.server.state import ServerState, ServerStatus
from tokenmill.server.stats import LiveWindow
from tokenmill.server.usage import UsageMeter, UsageStore, parse_usage_query

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


def create_app(config: ServerConfig, load_engine: Callable[[], AsyncEngine]) -> FastAPI:
    """An app that loads its engine with ``load_engine`` (in a thread) once it starts.

    ``app.state.tokenmill`` is the ServerState (status, engine, drain); ``app.state.metrics``
    the ServerMetrics with the app's own registry.
    """
    state = ServerState(config, load_engine)
    metrics = ServerMetrics(config.served_model_name, state.stats, config.stats_window)
    meter = UsageMeter(
        UsageStore(config.usage_db), config.prices, metrics.registry, config.usage_flush_interval
    )
    limiter = RateLimiter(config.rate_limit_rpm, config.rate_limit_tpm)
    serving = OpenAIServing(state, metrics, meter, limiter if limiter.is_enabled else None)
    ollama = OllamaServing(serving)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.start_loading()
        meter.start()
        logger.info(
            "serving %r at http://%s:%d/v1 (health: /health, metrics: /metrics)",
            config.served_model_name,
            config.host,
            config.port,
        )
        tasks = [asyncio.create_task(_sample_engine(metrics.window, state))]
        if config.log_stats_interval > 0:
            tasks.append(
                asyncio.create_task(
                    log_stats_periodically(metrics, state.stats, config.log_stats_interval)
                )
            )
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await state.begin_drain(config.shutdown_timeout)
            # After the drain every run has closed and been metered: nothing is lost.
            await asyncio.to_thread(meter.close)

    from tokenmill import __version__

    app = FastAPI(
        title="tokenmill",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.tokenmill = state
    app.state.metrics = metrics
    app.state.usage = meter
    install_error_handlers(app)
    public_paths = (*EXEMPT_PATHS, *(("/metrics",) if config.metrics_public else ()))
    app.add_middleware(
        APIKeyMiddleware,
        api_keys=config.api_keys,
        admin_api_key=config.admin_api_key,
        exempt_paths=public_paths,
    )
    has_keys = bool(config.api_keys) or config.admin_api_key is not None

    async def read_body(request: Request, model: type[M]) -> M:
        state.require_engine()  # 503 before reading a body that cannot be served
        return await _read_json(request, model, config.max_body_bytes)

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.status is ServerStatus.READY:
            if state.engine is not None and state.engine.is_dead:
                return JSONResponse({"status": "engine_failed"}, status_code=503)
            return JSONResponse({"status": "ok"})
        body: dict[str, str] = {"status": state.status.value}
        if state.load_error is not None:
            body["error"] = str(state.load_error)
        return JSONResponse(body, status_code=503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse(serving.models().model_dump(mode="json"))

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> JSONResponse:
        return JSONResponse(serving.model(model_id).model_dump(mode="json"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_body(request, CompletionRequest)
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_body(request, ChatCompletionRequest)
        return await serving.chat(body, request)

    def _check_admin(request: Request, path: str, what: str) -> None:
        # Control routes exist only when API keys guard the server (the middleware checked
        # them); with --admin-api-key, only that key may use them.
        if not has_keys:
            raise APIError(404, f"{path} is enabled only with --api-key", code="not_found")
        if config.admin_api_key is not None and not caller_of(request).is_admin:
            raise APIError(403, f"only the admin key may {what}", code="permission_denied")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> JSONResponse:
        _check_admin(request, "/reset_prefix_cache", "reset the prefix cache")
        engine = state.require_engine()
        return JSONResponse({"reset": await engine.reset_prefix_cache()})

    @app.post("/abort_request")
    async def abort_request(request: Request) -> JSONResponse:
        _check_admin(request, "/abort_request", "abort requests")
        body = await read_body(request, AbortRequest)
        engine = state.require_engine()
        return JSONResponse({"aborted": serving.abort(engine, body.request_id)})

    @app.get("/v1/usage")
    async def usage(request: Request) -> JSONResponse:
        query = parse_usage_query(request.query_params.multi_items(), caller_of(request))
        report = await asyncio.to_thread(meter.report, query)
        return JSONResponse(report.model_dump(mode="json"))

    @app.get("/v1/stats")
    async def live_stats() -> JSONResponse:
        stats = metrics.window.snapshot(
            state.stats() or EngineStats(),
            config.prices,
            config.price_per_hour,
            config.served_model_name,
            state.status.value,
        )
        return JSONResponse(stats.model_dump(mode="json"))

    @app.get("/dashboard")
    async def dashboard() -> Response:
        return _static_response("dashboard.html")

    @app.get("/docs")
    async def docs() -> Response:
        return _static_response("docs.html")

    @app.get("/openapi.json")
    async def openapi() -> JSONResponse:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_schema(
                app,
                has_keys,
                SCRIPTS,
                metrics_public=config.metrics_public,
                model_name=config.served_model_name,
            )
        return JSONResponse(app.openapi_schema)

    @app.get("/static/{name}")
    async def static(name: str) -> Response:
        if name not in SCRIPTS:  # the pages have their own routes
            raise APIError(404, f"no static file {name!r}", code="not_found")
        return _static_response(name)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = await read_body(request, TokenizeRequest)
        return JSONResponse((await serving.tokenize(body)).model_dump(mode="json"))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        body = await read_body(request, DetokenizeRequest)
        return JSONResponse((await serving.detokenize(body)).model_dump(mode="json"))

    # ---- Ollama's API ------------------------------------------------------------------------

    @app.post("/api/chat")
    async def ollama_chat(request: Request) -> Response:
        return await ollama.chat(await read_body(request, ChatRequest), request)

    @app.post("/api/generate")
    async def ollama_generate(request: Request) -> Response:
        return await ollama.generate(await read_body(request, GenerateRequest), request)

    @app.get("/api/tags")
    async def ollama_tags() -> JSONResponse:
        return JSONResponse(ollama.tags())

    @app.get("/api/ps")
    async def ollama_ps() -> JSONResponse:
        return JSONResponse(ollama.ps())

    @app.post("/api/show")
    async def ollama_show(request: Request) -> JSONResponse:
        return JSONResponse(ollama.show(await read_body(request, ShowRequest)))

    @app.get("/api/version")
    async def ollama_version() -> dict[str, str]:
        return {"version": __version__}

    return app


# The files under static/ the server sends (package data), and their types.
STATIC_FILES = {
    "dashboard.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "docs.html": "text/html; charset=utf-8",
    "docs.js": "text/javascript; charset=utf-8",
}
SCRIPTS = ("dashboard.js", "docs.js")  # what /static/{name} serves


def _static_response(name: str) -> Response:
    if name not in STATIC_FILES:
        raise APIError(404, f"no static file {name!r}", code="not_found")
    body = (importlib.resources.files("tokenmill.server") / "static" / name).read_bytes()
    return Response(body, media_type=STATIC_FILES[name], headers={"Cache-Control": "no-cache"})


async def _sample_engine(window: LiveWindow, state: ServerState) -> None:
    """The engine's counters into the dashboard's window, once a second."""
    while True:
        window.sample_engine(state.stats() or EngineStats())
        await asyncio.sleep(1.0)


async def _read_json(request: Request, model: type[M], max_bytes: int) -> M:
    """Read at most ``max_bytes`` of body (413 beyond) and parse it strictly (400)."""
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
    body = b"".join(parts)
    if not body.strip():
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_type")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise from_validation_error(e) from None
