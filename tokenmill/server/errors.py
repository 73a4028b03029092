"""OpenAI-style errors: one exception type, one body shape, handlers for the app (and
Ollama's ``{"error": message}`` on its /api/ routes).

Every error the server sends has the body ``{"error": {"message", "type", "param", "code"}}``.
``code`` is a short snake_case string, as OpenAI's are; ``param`` names the request field at fault
(or is null).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered to the client with an HTTP status and an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    @property
    def type(self) -> str:
        return _ERROR_TYPES.get(self.status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self, path: str = "") -> JSONResponse:
        """The response to a request for ``path`` (Ollama's error shape on its routes)."""
        body = error_body_for(path, self.status, self.message, param=self.param, code=self.code)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


# Ollama's routes (server/ollama.py) answer errors as Ollama does: {"error": message}.
OLLAMA_PREFIX = "/api/"


# Anthropic's Messages routes (server/anthropic.py) answer as Anthropic does:
# {"type": "error", "error": {"type", "message"}}.
ANTHROPIC_PREFIX = "/v1/messages"
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body_for(
    path: str, status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The error body a client of ``path`` expects: Ollama's on /api/, Anthropic's on
    /v1/messages, else OpenAI's."""
    if path.startswith(OLLAMA_PREFIX):
        return {"error": message}
    if path.startswith(ANTHROPIC_PREFIX):
        kind = _ANTHROPIC_TYPES.get(status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    return error_body(status, message, param=param, code=code)


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


# SamplingParams / LLMEngine messages start with the field name ("top_p must be ...").
_LEADING_FIELD = re.compile(r"^([a-z_]+) (?:must|keys must)\b")


def from_value_error(
    error: ValueError, renames: dict[str, str] | None = None, prompt_param: str = "prompt"
) -> APIError:
    """A ValueError from validation or tokenization -> 400 naming the field at fault.

    ``renames`` maps engine field names to the names the request used (for chat, the engine's
    ``logprobs`` is the request's ``top_logprobs``); ``prompt_param`` is the request field that
    holds the prompt ("prompt", or "messages" for chat).
    """
    message = str(error)
    renames = renames or {}
    code = "invalid_value"
    if message.startswith("prompt ("):  # prompt + max_tokens beyond the context
        param, code = "max_tokens", "context_length_exceeded"
    elif message.startswith("prompt has"):  # the prompt alone fills the context
        param, code = prompt_param, "context_length_exceeded"
    elif message.startswith("prompt"):
        param = prompt_param
    else:
        match = _LEADING_FIELD.match(message)
        param = match.group(1) if match else None
    if param in renames:
        new = renames[param]
        message = re.sub(rf"\b{param}\b", new, message)
        param = new
    return APIError(400, message, param=param, code=code)


_TYPE_HINTS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "messages": "a list of {role, content} objects",
    "logit_bias": "an object mapping token ids (as strings) to numbers",
}


def from_validation_error(error: ValidationError) -> APIError:
    """The first pydantic error -> 400 naming the field (malformed JSON, wrong type, extra)."""
    first = error.errors(include_url=False)[0]
    kind = first["type"]
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return APIError(400, f"malformed JSON body: {detail}", code="malformed_json")
    loc = [str(p) for p in first["loc"] if _is_path_part(p)]
    field = ".".join(loc) if loc else None
    top = loc[0] if loc else None
    if kind == "extra_forbidden":
        return APIError(
            400,
            f"unknown field '{field}': not part of this endpoint's request",
            param=field,
            code="unknown_field",
        )
    if kind == "missing":
        return APIError(400, f"'{field}' is required", param=field, code="missing_field")
    if kind == "model_type" and not loc:
        return APIError(400, "the request body must be a JSON object", code="invalid_type")
    hint = _TYPE_HINTS.get(top or "")
    message = f"'{field}': {first['msg']}"
    if hint and len(loc) == 1:
        message = f"'{field}' must be {hint}"
    return APIError(400, message, param=field, code="invalid_type")


def _is_path_part(part: object) -> bool:
    # Union branches show up in locations as type names ("str", "list[int]"); skip them.
    if isinstance(part, int):
        return True
    text = str(part)
    return not ("[" in text or text in ("str", "int", "float", "bool", "dict", "list", "none"))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
            code = "not_found"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
            code = "method_not_allowed"
        else:
            message, code = str(exc.detail), None
        return JSONResponse(
            error_body_for(request.url.path, exc.status_code, message, code=code),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s %s", request.method, request.url.path)
        message = f"internal server error: {type(exc).__name__}"
        return JSONResponse(
            error_body_for(request.url.path, 500, message, code="internal_error"),
            status_code=500,
        )
