"""The FastAPI app: the routers' routes (server/routers/), the key middleware, the error
handlers, and the lifespan (background model load, stats sampling and log, drain).

The routes themselves, with their bodies and answers, are in server/routers/: openai.py,
ollama.py, admin.py and pages.py; /openapi.json is built from them (server/openapi.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI
from fastapi.routing import APIRoute

from tokenmill import __version__
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.outputs import EngineStats
from tokenmill.server.anthropic import AnthropicServing
from tokenmill.server.auth import APIKeyMiddleware
from tokenmill.server.config import ServerConfig
from tokenmill.server.embeddings import EmbeddingServing
from tokenmill.server.errors import install_error_handlers
from tokenmill.server.limits import RateLimiter
from tokenmill.server.metrics import ServerMetrics, log_stats_periodically
from tokenmill.server.ollama import OllamaServing
from tokenmill.server.openapi import is_public
from tokenmill.server.responses import ResponsesServing, ResponseStore
from tokenmill.server.routers import admin, anthropic, ollama, openai, pages, responses
from tokenmill.server.routing import Services
from tokenmill.server.serving import OpenAIServing
from tokenmill.server.state import ServerState
from tokenmill.server.stats import LiveWindow
from tokenmill.server.usage import UsageMeter, UsageStore

logger = logging.getLogger(__name__)

ROUTERS = (
    openai.router, responses.router, anthropic.router, ollama.router, admin.router, pages.router
)  # fmt: skip


def create_app(config: ServerConfig, load_engine: Callable[[], AsyncEngine]) -> FastAPI:
    """An app that loads its engine with ``load_engine`` (in a thread) once it starts.

    ``app.state.services`` holds what the handlers use (routing.Services): among them the
    ServerState (status, engine, drain) and the ServerMetrics with the app's own registry.
    """
    state = ServerState(config, load_engine)
    metrics = ServerMetrics(config.served_model_name, state.stats, config.stats_window)
    meter = UsageMeter(
        UsageStore(config.usage_db), config.prices, metrics.registry, config.usage_flush_interval
    )
    limiter = RateLimiter(config.rate_limit_rpm, config.rate_limit_tpm)
    serving = OpenAIServing(state, metrics, meter, limiter if limiter.is_enabled else None)
    store = ResponseStore(config.responses_store_size, config.responses_ttl)
    ollama = OllamaServing(serving)
    services = Services(
        config, state, metrics, meter, serving, ollama, AnthropicServing(serving),
        ResponsesServing(serving, store), EmbeddingServing(serving, ollama),
    )  # fmt: skip

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

    # The routers' routes go straight into the app (not include_router), so app.routes lists
    # each APIRoute on every FastAPI version.
    routes = [route for router in ROUTERS for route in router.routes]
    app = FastAPI(
        title="tokenmill",
        version=__version__,
        lifespan=lifespan,
        routes=routes,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.services = services
    install_error_handlers(app)
    public = [r for r in routes if isinstance(r, APIRoute) and is_public(r)]
    public += [r for r in routes if config.metrics_public and getattr(r, "path", "") == "/metrics"]
    app.add_middleware(
        APIKeyMiddleware,
        api_keys=config.api_keys,
        admin_api_key=config.admin_api_key,
        public_paths=[route.path_regex for route in public],
    )
    return app


async def _sample_engine(window: LiveWindow, state: ServerState) -> None:
    """The engine's counters into the dashboard's window, once a second."""
    while True:
        window.sample_engine(state.stats() or EngineStats())
        await asyncio.sleep(1.0)
