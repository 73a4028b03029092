"""The operator's routes: health, version, Prometheus metrics, metered usage, live figures, and
two controls that exist only when API keys guard the server (with ``--admin-api-key``, only
that key may use them)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tokenmill import __version__
from tokenmill.outputs import EngineStats
from tokenmill.server.auth import caller_of
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import (
    AbortRequest,
    AbortResponse,
    HealthResponse,
    LiveStats,
    ResetPrefixCacheResponse,
    UsageReport,
    VersionResponse,
)
from tokenmill.server.routing import PUBLIC, App, JSONBodyRoute, example, services_of
from tokenmill.server.state import ServerStatus
from tokenmill.server.usage import parse_usage_query

router = APIRouter(route_class=JSONBodyRoute)


def _query(name: str, description: str, enum: list[str] | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = (
        {"type": "string"} if enum is None else {"type": "string", "enum": enum}
    )
    return {"name": name, "in": "query", "required": False, "description": description,
            "schema": schema}  # fmt: skip


# /v1/usage reads its query itself (usage.parse_usage_query: its own 400s and 403s); these
# describe it.
USAGE_PARAMETERS = [
    _query("key", "an API key whose usage to report (admin; a user key may name only itself)"),
    _query("key_id", "the same by key id (8 hex digits, as reports show)"),
    _query("user", "only requests that sent this 'user'"),
    _query("since", "from this time on: unix seconds or ISO 8601 (2026-01-31, ...T12:00:00Z)"),
    _query("until", "before this time (same forms)"),
    _query(
        "group_by", "one row per day (UTC), key, model or user", ["day", "key", "model", "user"]
    ),
]


@router.get(
    "/health",
    summary="200 when ready, else 503 (no key needed)",
    response_model=HealthResponse,
    openapi_extra=PUBLIC,
)
async def health(app: App) -> JSONResponse:
    state = app.state
    if state.status is ServerStatus.READY:
        if state.engine is not None and state.engine.is_dead:
            return JSONResponse({"status": "engine_failed"}, status_code=503)
        return JSONResponse({"status": "ok"})
    body: dict[str, str] = {"status": state.status.value}
    if state.load_error is not None:
        body["error"] = str(state.load_error)
    return JSONResponse(body, status_code=503)


@router.get("/version", summary="tokenmill's version", response_model=VersionResponse)
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
async def metrics(app: App) -> Response:
    return Response(app.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get(
    "/v1/usage",
    summary="Metered usage and cost: any key's for the admin key, its own for a user key",
    response_model=UsageReport,
    openapi_extra={"parameters": USAGE_PARAMETERS},
)
async def usage(request: Request, app: App) -> JSONResponse:
    query = parse_usage_query(request.query_params.multi_items(), caller_of(request))
    report = await asyncio.to_thread(app.meter.report, query)
    return JSONResponse(report.model_dump(mode="json"))


STATS_MODEL = _query(
    "model",
    "Whose figures (a server of many models: a loaded one; default: the most recently used)",
)


@router.get(
    "/v1/stats",
    summary="Live figures over a sliding window (the dashboard's data)",
    response_model=LiveStats,
    openapi_extra={"parameters": [STATS_MODEL]},
)
async def live_stats(request: Request, app: App) -> JSONResponse:
    config = app.config
    model = request.query_params.get("model")
    if model is not None and model.removesuffix(":latest") != config.served_model_name:
        raise APIError(404, f"model '{model}' is not served here; this server serves "
                       f"'{config.served_model_name}'", code="model_not_found")  # fmt: skip
    stats = app.metrics.window.snapshot(
        app.state.stats() or EngineStats(),
        config.prices,
        config.price_per_hour,
        config.served_model_name,
        app.state.status.value,
    )
    return JSONResponse(stats.model_dump(mode="json"))


# ---- controls ---------------------------------------------------------------------------------


def admin_only(what: str) -> Any:
    """A dependency: control routes exist only when API keys guard the server (the key
    middleware checked the key); with --admin-api-key, only that key may ``what``."""

    def check(request: Request) -> None:
        config = services_of(request).config
        if not config.api_keys and config.admin_api_key is None:
            path = request.url.path
            raise APIError(404, f"{path} is enabled only with --api-key", code="not_found")
        if config.admin_api_key is not None and not caller_of(request).is_admin:
            raise APIError(403, f"only the admin key may {what}", code="permission_denied")

    return Depends(check)


@router.post(
    "/reset_prefix_cache",
    summary="Forget cached prefix blocks (needs keys; the admin key when there is one)",
    response_model=ResetPrefixCacheResponse,
    dependencies=[admin_only("reset the prefix cache")],
)
async def reset_prefix_cache(app: App) -> JSONResponse:
    engine = app.state.require_engine()
    return JSONResponse({"reset": await engine.reset_prefix_cache()})


@router.post(
    "/abort_request",
    summary="Abort an unfinished request by its id (needs keys; the admin key when there is one)",
    response_model=AbortResponse,
    dependencies=[admin_only("abort requests")],
    openapi_extra=example({"request_id": "cmpl-0123"}),
)
async def abort_request(body: AbortRequest, app: App) -> JSONResponse:
    engine = app.state.require_engine()
    return JSONResponse({"aborted": app.openai.abort(engine, body.request_id)})
