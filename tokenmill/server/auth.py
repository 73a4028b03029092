"""API-key check for every route but /health, as ASGI middleware (so unknown routes are covered).

A key comes as ``Authorization: Bearer <key>`` or ``X-Api-Key: <key>``. Keys are compared as
SHA-256 digests with ``hmac.compare_digest`` against every configured key, so the time taken
says nothing about how much of a key matched, nor which key.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.server.errors import error_body_for

EXEMPT_PATHS = ("/health",)


class APIKeyMiddleware:
    def __init__(
        self, app: ASGIApp, api_keys: Sequence[str], exempt_paths: Iterable[str] = EXEMPT_PATHS
    ) -> None:
        self.app = app
        self._digests = [_digest(key.encode()) for key in api_keys]
        self._exempt = frozenset(exempt_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or not self._digests
            or scope["path"] in self._exempt
            or self._is_authorized(scope)
        ):
            await self.app(scope, receive, send)
            return
        response = JSONResponse(
            error_body_for(
                scope["path"],
                401,
                "missing or invalid API key: send it as 'Authorization: Bearer <key>' "
                "or 'X-Api-Key: <key>'",
                code="invalid_api_key",
            ),
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)

    def _is_authorized(self, scope: Scope) -> bool:
        presented = _presented_key(scope)
        if presented is None:
            return False
        digest = _digest(presented)
        matched = False
        for expected in self._digests:  # no early exit: every key is compared
            matched |= hmac.compare_digest(digest, expected)
        return matched


def _presented_key(scope: Scope) -> bytes | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
        elif name == b"x-api-key" and value.strip():
            return value.strip()
    return None


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()
