"""Forwarding one request: pick a replica, retry before the first token, stream the answer.

An attempt fails, and the request moves to another replica, when it cannot connect, the
connection breaks before the first token, the replica answers 5xx (a 503 also marks it down)
or its stream's first event is an error another replica may not have (RETRYABLE_CODES: a
draining replica aborts the requests it queued). Nothing has reached the client then: the
router holds the response until the first chunk that carries output (for SSE, the first event
that is not chat's role-only preamble). After that the upstream body passes through chunk by
chunk; a replica lost mid-stream ends an SSE stream with an error event and ``[DONE]`` (the
server's own abort shape).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenmill.router.policy import request_key
from tokenmill.router.replicas import ReplicaSet

logger = logging.getLogger(__name__)

# Not forwarded either way: per-connection headers, and the body framing httpx / uvicorn redo.
# accept-encoding is dropped so replicas answer uncompressed bytes the router can inspect.
_HOP_HEADERS = frozenset(
    b"host connection keep-alive transfer-encoding te trailer upgrade content-length "
    b"proxy-authorization proxy-authenticate accept-encoding".split()
)
# uvicorn writes its own date and server headers.
_RESPONSE_DROPPED = _HOP_HEADERS | {b"date", b"server"}
REPLICA_HEADER = "X-Tokenmill-Replica"

_ERROR_TYPES = {401: "authentication_error", 502: "server_error", 503: "service_unavailable"}


def error_response(path: str, status: int, message: str, code: str) -> JSONResponse:
    """An OpenAI-style error (Ollama's ``{"error": message}`` on /api/), as the server's."""
    if path.startswith("/api/"):
        return JSONResponse({"error": message}, status_code=status)
    kind = _ERROR_TYPES.get(status, "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return JSONResponse(body, status_code=status)


class PayloadTooLarge(Exception):
    pass


async def read_body(request: Request, max_bytes: int) -> bytes:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise PayloadTooLarge
    return bytes(body)


def is_preamble(event: bytes) -> bool:
    """An SSE event that carries no output: chat's first chunk (role, empty content)."""
    data = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
    try:
        chunk = json.loads(data)
    except ValueError:
        return False
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    if not choices or not isinstance(choices, list):
        return False
    for choice in choices:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict) or choice.get("finish_reason") is not None:
            return False
        if set(delta) - {"role", "content"} or delta.get("content"):
            return False
    return True


def first_output_event(buffer: bytes) -> bytes | None:
    """The first complete SSE event of ``buffer`` that is not a preamble (None: none yet)."""
    *complete, _rest = buffer.replace(b"\r\n", b"\n").split(b"\n\n")
    return next((e for e in complete if e.strip() and not is_preamble(e)), None)


# Errors a replica streams before any output that another replica may not have: it is
# shutting down or its engine failed (the server's SSE error codes), or its queue is full.
RETRYABLE_CODES = frozenset({"aborted", "shutting_down", "engine_error", "queue_full"})


def retryable_error(event: bytes) -> str | None:
    """The code of an SSE error event worth retrying elsewhere, else None."""
    data = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
    try:
        error = json.loads(data).get("error")
    except (ValueError, AttributeError):
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return code if code in RETRYABLE_CODES else None


class ProxyResponse(StreamingResponse):
    """A streamed upstream body that always runs ``on_close`` (also if never iterated)."""

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], Any], **kw: Any):
        super().__init__(body, **kw)
        self._on_close = [on_close]

    def also_on_close(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` after the response closes (host/: a model's lease ends)."""
        self._on_close.append(callback)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            first, *after = self._on_close
            try:
                await first()
            finally:
                for callback in after:
                    callback()


class Proxy:
    """Forwards requests to the replicas of ``replicas`` over one shared httpx client."""

    def __init__(self, client: httpx.AsyncClient, replicas: ReplicaSet, max_body_bytes: int):
        self.client = client
        self.replicas = replicas
        self.max_body_bytes = max_body_bytes

    async def forward(
        self,
        request: Request,
        routed: bool,
        body: bytes | None = None,
        set_headers: dict[str, str] | None = None,
    ) -> Response:
        """Send ``request`` on; ``routed``: by its prompt's prefix (else to the least loaded).
        ``body``: the request's body when the caller has read it (host/: to find the model);
        ``set_headers``: headers of the caller's, in place of any the client sent."""
        path = request.url.path
        if body is None:
            try:
                body = await read_body(request, self.max_body_bytes)
            except PayloadTooLarge:
                return error_response(
                    path, 413, f"request body above {self.max_body_bytes} bytes", "body_too_large"
                )
        key = _key_of(body) if routed else None
        own = {k.lower().encode(): v.encode() for k, v in (set_headers or {}).items()}
        headers = [(k, v) for k, v in request.headers.raw
                   if k.lower() not in _HOP_HEADERS and k.lower() not in own]  # fmt: skip
        headers += own.items()
        target = path + (f"?{request.url.query}" if request.url.query else "")
        tried: list[int] = []
        failure: Response | None = None
        while (decision := self.replicas.choose(key, tried)) is not None:
            idx = decision.replica_idx
            tried.append(idx)
            if routed:
                self.replicas.decisions[decision.reason] += 1
            response = await self._attempt(idx, request.method, target, headers, body)
            if isinstance(response, ProxyResponse):
                return response
            failure = response or failure
        if failure is not None:  # the last 5xx a replica answered
            return failure
        if tried:
            return error_response(
                path, 502, f"no replica could serve the request (tried {len(tried)})",
                "replica_unavailable",
            )  # fmt: skip
        return error_response(path, 503, "no healthy replica", "no_healthy_replica")

    async def broadcast(self, request: Request, any_replica: bool = False) -> Response:
        """Send ``request`` to every healthy replica (a prefix-cache reset): the first answer
        that is not 2xx, else the last one. ``any_replica`` (an abort, which one replica
        holds): the first 2xx answer, else the first that is not a 404, else a 404."""
        path = request.url.path
        body = await request.body()
        headers = [(k, v) for k, v in request.headers.raw if k.lower() not in _HOP_HEADERS]
        healthy = [r for r in self.replicas.replicas if r.healthy]
        if not healthy:
            return error_response(path, 503, "no healthy replica", "no_healthy_replica")
        answers = []
        for replica in healthy:
            try:
                answers.append(
                    await self.client.request(
                        request.method, replica.url + path, headers=headers, content=body
                    )
                )
            except httpx.TransportError as e:
                message = f"replica {replica.url} did not answer: {type(e).__name__}"
                return error_response(path, 502, message, "replica_unavailable")
        if any_replica:
            answer = next((a for a in answers if a.is_success), None)
            answer = answer or next((a for a in answers if a.status_code != 404), answers[0])
        else:
            answer = next((a for a in answers if not a.is_success), answers[-1])
        return Response(answer.content, answer.status_code, _headers(answer))

    async def _attempt(
        self, idx: int, method: str, target: str, headers: list, body: bytes
    ) -> Response | None:
        """One try on replica ``idx``: its committed response (a ProxyResponse), or when it
        failed, its 5xx answer or None."""
        replica = self.replicas[idx]
        replica.in_flight += 1
        replica.num_requests += 1
        upstream: httpx.Response | None = None
        try:
            req = self.client.build_request(
                method, replica.url + target, headers=headers, content=body
            )
            upstream = await self.client.send(req, stream=True)
            if upstream.status_code >= 500:
                content = await upstream.aread()
                raise _Failed(
                    f"answered {upstream.status_code}",
                    down=upstream.status_code == 503,
                    response=Response(content, upstream.status_code, _headers(upstream)),
                )
            chunks = upstream.aiter_raw()
            head = await _read_head(upstream, chunks)
        except (httpx.TransportError, _Failed) as e:
            replica.in_flight -= 1
            replica.num_failures += 1
            if upstream is not None:
                await upstream.aclose()
            failed = e if isinstance(e, _Failed) else _Failed(f"{type(e).__name__}: {e}")
            if failed.down:
                self.replicas.mark_down(idx, failed.why)
            logger.warning("request to %s failed before output: %s", replica.url, failed.why)
            return failed.response
        except BaseException:  # cancelled: nothing to answer, but the count must hold
            replica.in_flight -= 1
            if upstream is not None:
                await upstream.aclose()
            raise
        closed = False

        async def close() -> None:
            nonlocal closed
            if not closed:
                closed = True
                replica.in_flight -= 1
                await upstream.aclose()

        return ProxyResponse(
            self._pass_through(idx, upstream, head, chunks),
            close,
            status_code=upstream.status_code,
            headers={**_headers(upstream), REPLICA_HEADER: replica.url},
        )

    async def _pass_through(
        self, idx: int, upstream: httpx.Response, head: list[bytes], chunks: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes]:
        for chunk in head:
            yield chunk
        try:
            async for chunk in chunks:
                yield chunk
        except httpx.TransportError as e:
            self.replicas.mark_down(idx, f"lost mid-response: {type(e).__name__}: {e}")
            media = upstream.headers.get("content-type", "")
            message = "the replica serving this request failed mid-stream"
            if media.startswith("text/event-stream"):
                error = {"message": message, "type": "server_error", "param": None,
                         "code": "replica_lost"}  # fmt: skip
                yield f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()
            elif media.startswith("application/x-ndjson"):
                yield (json.dumps({"error": message}) + "\n").encode()


class _Failed(Exception):
    """An attempt that failed before output; ``response``: a 5xx to answer if all fail."""

    def __init__(self, why: str, down: bool = True, response: Response | None = None) -> None:
        super().__init__(why)
        self.why = why
        self.down = down
        self.response = response


async def _read_head(upstream: httpx.Response, chunks: AsyncIterator[bytes]) -> list[bytes]:
    """The body up to its first chunk with output (all of it if shorter).

    Raises _Failed when an SSE body's first event is an error worth retrying elsewhere.
    """
    sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
    head: list[bytes] = []
    async for chunk in chunks:
        head.append(chunk)
        if not sse:
            break
        event = first_output_event(b"".join(head))
        if event is not None:
            code = retryable_error(event)
            if code is not None:
                raise _Failed(f"streamed error {code!r} before output", down=code != "queue_full")
            break
    return head


def _headers(upstream: httpx.Response) -> dict[str, str]:
    return {
        k: v for k, v in upstream.headers.items() if k.lower().encode() not in _RESPONSE_DROPPED
    }


def _key_of(body: bytes) -> str | None:
    try:
        parsed = json.loads(body)
    except ValueError:
        return None  # the replica answers the 400
    return request_key(parsed) if isinstance(parsed, dict) else None
