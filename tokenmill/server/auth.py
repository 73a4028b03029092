"""API-key check for every route but the open ones, as ASGI middleware (so unknown routes are
covered), and who the caller is.

A key comes as ``Authorization: Bearer <key>`` or ``X-Api-Key: <key>``. Keys are compared as
SHA-256 digests with ``hmac.compare_digest`` against every configured key, so the time taken
says nothing about how much of a key matched, nor which key.

The caller of an authorized request is written into the ASGI scope (``scope["state"]``, read
back by ``caller_of``): its key id (the first 8 hex digits of the key's SHA-256, the only form
in which a key is stored or shown) and whether it is the admin key.

Open routes are the ones the routers declare public (routing.PUBLIC: /health, and the pages
/dashboard and /docs with their static files), and /metrics with ``--metrics-public``; the app
passes their path patterns in ``public_paths``. The pages hold no data; their scripts ask for
the key once and send it to the data routes (/v1/stats, /openapi.json), which are guarded
like every other.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.server.errors import error_body_for

# The key id of requests to a server without keys.
NO_KEY_ID = "none"
_SCOPE_KEY = "tokenmill_caller"


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request: ``key_id`` of its key (NO_KEY_ID without keys), admin or not."""

    key_id: str = NO_KEY_ID
    is_admin: bool = False


# A server without keys: everyone is everything.
OPEN_CALLER = Caller(NO_KEY_ID, is_admin=True)


def key_id_of(key: str | bytes) -> str:
    """The id a key is stored and shown as: the first 8 hex digits of its SHA-256."""
    raw = key.encode() if isinstance(key, str) else key
    return _digest(raw).hex()[:8]


def caller_of(request: Request) -> Caller:
    """The caller the middleware let in (OPEN_CALLER on a server without keys)."""
    return request.scope.get("state", {}).get(_SCOPE_KEY, OPEN_CALLER)


class APIKeyMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        api_keys: Sequence[str],
        admin_api_key: str | None = None,
        public_paths: Iterable[re.Pattern[str]] = (),
    ) -> None:
        self.app = app
        keys = [(key, False) for key in api_keys]
        if admin_api_key is not None:
            keys.append((admin_api_key, True))
        self._digests = [(_digest(key.encode()), is_admin) for key, is_admin in keys]
        self._public = tuple(public_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._digests:
            await self.app(scope, receive, send)
            return
        caller = self._caller(scope)
        if caller is not None:
            scope.setdefault("state", {})[_SCOPE_KEY] = caller
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if any(pattern.match(path) for pattern in self._public):
            await self.app(scope, receive, send)
            return
        response = JSONResponse(
            error_body_for(
                path,
                401,
                "missing or invalid API key: send it as 'Authorization: Bearer <key>' "
                "or 'X-Api-Key: <key>'",
                code="invalid_api_key",
            ),
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)

    def _caller(self, scope: Scope) -> Caller | None:
        presented = _presented_key(scope)
        if presented is None:
            return None
        digest = _digest(presented)
        matched = False
        is_admin = False
        for expected, admin in self._digests:  # no early exit: every key is compared
            equal = hmac.compare_digest(digest, expected)
            matched |= equal
            is_admin |= equal and admin
        if not matched:
            return None
        return Caller(digest.hex()[:8], is_admin)


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
