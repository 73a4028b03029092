"""Anthropic's Messages API (its errors are Anthropic's, errors.error_body_for). The logic is
server/anthropic.py's."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.server.anthropic import (
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
    MessageStreamEvent,
)
from tokenmill.server.routing import App, JSONBodyRoute, example, streams

router = APIRouter(route_class=JSONBodyRoute)


@router.post(
    "/v1/messages",
    summary="Anthropic Messages; Anthropic's SSE events with stream: true",
    response_model=MessageResponse,
    openapi_extra=example(
        {"model": "{model}", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    ),
)
@streams(MessageStreamEvent)
async def messages(body: MessagesRequest, request: Request, app: App) -> Response:
    return await app.anthropic.messages(body, request)


@router.post(
    "/v1/messages/count_tokens",
    summary="Anthropic: the tokens a Messages request's prompt takes",
    response_model=CountTokensResponse,
    openapi_extra=example({"model": "{model}", "messages": [{"role": "user", "content": "Hi"}]}),
)
async def count_tokens(body: CountTokensRequest, app: App) -> JSONResponse:
    return JSONResponse((await app.anthropic.count_tokens(body)).model_dump(mode="json"))
