"""The pages (no key needed: they hold no data, and their scripts ask for the key) and the
OpenAPI document they read."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from tokenmill import pages
from tokenmill.server.errors import APIError
from tokenmill.server.openapi import openapi_schema
from tokenmill.server.routing import PUBLIC, App

router = APIRouter()


@router.get(
    "/dashboard",
    summary="The live dashboard page (no key needed: it asks)",
    response_class=HTMLResponse,
    openapi_extra=PUBLIC,
)
async def dashboard() -> Response:
    return _static_response("dashboard.html")


@router.get(
    "/docs",
    summary="This document, readable (no key needed: it asks)",
    response_class=HTMLResponse,
    openapi_extra=PUBLIC,
)
async def docs() -> Response:
    return _static_response("docs.html")


class JavaScriptResponse(Response):
    media_type = "text/javascript"


@router.get(
    "/static/{name}",
    summary="The pages' scripts",
    response_class=JavaScriptResponse,
    openapi_extra=PUBLIC,
)
async def static(
    name: Annotated[str, Path(json_schema_extra={"enum": list(pages.SCRIPTS)})],
) -> Response:
    if name not in pages.SCRIPTS:  # the pages have their own routes
        raise APIError(404, f"no static file {name!r}", code="not_found")
    return _static_response(name)


@router.get("/openapi.json", summary="This OpenAPI document")
async def openapi(request: Request, app: App) -> JSONResponse:
    fastapi_app = request.app
    if fastapi_app.openapi_schema is None:
        config = app.config
        fastapi_app.openapi_schema = openapi_schema(
            fastapi_app,
            has_keys=bool(config.api_keys) or config.admin_api_key is not None,
            metrics_public=config.metrics_public,
            model_name=config.served_model_name,
        )
    return JSONResponse(fastapi_app.openapi_schema)


def _static_response(name: str) -> Response:
    body, media_type = pages.read(name)
    return Response(body, media_type=media_type, headers={"Cache-Control": "no-cache"})
