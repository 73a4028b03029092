"""OpenAI's Responses API: create (JSON, or its SSE events with ``stream: true``), and the
stored responses by id. The logic is server/responses.py's."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.server.responses import (
    DeletedResponse,
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
)
from tokenmill.server.routing import App, JSONBodyRoute, example, streams

router = APIRouter(route_class=JSONBodyRoute)
ResponseId = Annotated[str, Path(examples=["resp-0"])]


@router.post(
    "/v1/responses",
    summary="OpenAI Responses; its SSE events with stream: true",
    response_model=ResponseObject,
    openapi_extra=example(
        {"model": "{model}", "input": "Name three colours.", "max_output_tokens": 8}
    ),
)
@streams(ResponseStreamEvent)
async def create_response(body: ResponsesRequest, request: Request, app: App) -> Response:
    return await app.responses.create(body, request)


@router.get(
    "/v1/responses/{response_id}",
    summary="A stored response (kept responses_ttl seconds, for the key that made it)",
    response_model=ResponseObject,
)
async def get_response(response_id: ResponseId, request: Request, app: App) -> JSONResponse:
    return JSONResponse(app.responses.retrieve(request, response_id).model_dump(mode="json"))


@router.delete(
    "/v1/responses/{response_id}",
    summary="Forget a stored response",
    response_model=DeletedResponse,
)
async def delete_response(response_id: ResponseId, request: Request, app: App) -> JSONResponse:
    return JSONResponse(app.responses.delete(request, response_id).model_dump(mode="json"))
