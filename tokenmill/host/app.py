"""The host's HTTP app: every route, for every model.

POST routes that name a model (``MODEL_ROUTES``)   the body's ``model`` picks the runner
    (none: the default model), which loads on the first request; the request is proxied to
    it, streamed through, and the runner's lease ends when the response does. Ollama's
    ``keep_alive`` in the body sets how long the model stays after; an /api/generate or
    /api/chat with no prompt (no messages) only loads it, or with keep_alive 0 unloads it.
GET  /v1/models, /v1/models/{id}, /api/tags   every model here, loaded or not
GET  /api/ps                                   the loaded ones: size, expiry
POST /api/show                                 read from the model's files (and its
                                               Modelfile), as Ollama's: nothing loads
GET  /v1/responses/{id}, DELETE                asked of each loaded runner in turn
POST /reset_prefix_cache, /abort_request       sent to every loaded runner
GET  /openapi.json, /v1/usage, /v1/stats          a loaded model's runner answers (none
                                               loaded: the default model's); /v1/stats?model=
                                               that loaded model's (the dashboard's choice);
                                               /tokenizer_info the default model's
GET  /dashboard, /docs, /static/{name}         the pages (pages/), sent by the host itself
POST /api/create, /api/copy; DELETE /api/delete
                                               created models (recipes.py): a Modelfile's
                                               fields, or its text; a TEMPLATE takes the
                                               admin key; no model file is ever touched
GET  /health, /api/version, /metrics           the host's own (/metrics: every runner's,
                                               each sample labelled by its model_name)
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tokenmill import __version__, pages, recipes
from tokenmill.catalog import LOAD_DURATION_HEADER, Entry, catalog, parameter_size
from tokenmill.host.config import HostConfig
from tokenmill.host.keep_alive import parse_keep_alive
from tokenmill.host.metrics import merged_metrics
from tokenmill.host.openapi import with_host_paths
from tokenmill.host.pool import HostError, Runner, RunnerPool, canonical, servable
from tokenmill.router.app import _KeyCheck, http_error
from tokenmill.router.proxy import PayloadTooLarge, ProxyResponse, error_response, read_body

logger = logging.getLogger(__name__)

MODEL_ROUTES = (
    "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses",
    "/v1/messages", "/v1/messages/count_tokens", "/tokenize", "/detokenize",
    "/api/generate", "/api/chat", "/api/embed", "/api/embeddings",
)  # fmt: skip
# Any loaded model's runner answers these alike (the usage database is shared); with none
# loaded, the default model's loads.
ANY_MODEL_ROUTES = ("/openapi.json", "/v1/usage", "/v1/stats")
DEFAULT_MODEL_ROUTES = ("/tokenizer_info",)
EACH_RUNNER = ("/v1/responses/{response_id}",)
BROADCAST = ("/reset_prefix_cache", "/abort_request")
FOREVER = "9999-12-31T23:59:59Z"


def create_app(config: HostConfig, pool: RunnerPool | None = None) -> Starlette:
    """The host app; ``pool`` (made in the lifespan when not given) holds the runners."""
    holder: dict[str, RunnerPool] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        timeout = httpx.Timeout(None, connect=5.0)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            holder["pool"] = pool or RunnerPool(config, client, catalog)
            reaper = asyncio.create_task(holder["pool"].reap_loop())
            try:
                yield
            finally:
                reaper.cancel()
                await holder["pool"].shutdown()

    def the_pool() -> RunnerPool:
        return holder["pool"]

    async def model_route(request: Request) -> Response:
        path = request.url.path
        try:
            body = await read_body(request, config.max_body_bytes)
        except PayloadTooLarge:
            return error_response(path, 413, f"request body above {config.max_body_bytes} "
                                  "bytes", "body_too_large")  # fmt: skip
        try:
            fields = json.loads(body) if body.strip() else {}
        except ValueError:
            fields = None  # not JSON: the runner of the default model says so
        if not isinstance(fields, dict):
            fields = {}
        ollama = path.startswith("/api/")
        name = fields.get("model") or fields.get("name")
        pool = the_pool()
        try:
            keep_alive = (
                parse_keep_alive(fields["keep_alive"]) if fields.get("keep_alive") is not None
                else config.keep_alive
            )  # fmt: skip
        except ValueError as e:
            return error_response(path, 400, str(e), "invalid_value")
        try:
            if ollama and _loads_only(path, fields):
                return await _load_or_unload(pool, name, keep_alive)
            asked, asked_wall = time.monotonic(), time.time()
            runner = await pool.acquire(name if isinstance(name, str) else None)
        except HostError as e:
            return error_response(path, e.status, e.message, e.code)
        # The runner came up while this request waited: Ollama's load_duration is that wait.
        waited = time.monotonic() - asked if runner.loaded_at >= asked_wall else 0.0
        if isinstance(name, str) and not ollama and canonical(name) != name:
            fields["model"] = canonical(name)  # the runner serves it by its plain name
            body = json.dumps(fields).encode()
        load = {LOAD_DURATION_HEADER: f"{waited:.6f}"}
        return await _forward(runner, request, body, lambda: pool.release(runner, keep_alive), load)

    async def default_route(request: Request) -> Response:
        """A page or figure any runner answers: watching a model neither loads it (save the
        default model when none is loaded) nor extends its keep_alive."""
        pool = the_pool()
        path = request.url.path
        try:
            if path == "/v1/stats" and "model" in request.query_params:
                runner = pool.acquire_loaded(request.query_params["model"])
            elif path not in DEFAULT_MODEL_ROUTES and pool.runners:
                recent = max(pool.runners.values(), key=lambda r: r.last_used)
                runner = pool.acquire_loaded(recent.name)
            else:
                runner = await pool.acquire(None)
        except HostError as e:
            return error_response(path, e.status, e.message, e.code)
        if path == "/openapi.json":  # the runner's routes, and the host's own
            try:
                answer = await pool.client.get(runner.url + "/openapi.json",
                                               headers=_forwarded_headers(request))  # fmt: skip
            finally:
                pool.release_watcher(runner)
            if answer.status_code != 200:
                return Response(answer.content, answer.status_code, _plain(answer))
            return JSONResponse(with_host_paths(answer.json(), config.default_model))
        body = await request.body()
        return await _forward(runner, request, body, lambda: pool.release_watcher(runner))

    async def each_runner(request: Request) -> Response:
        """A stored response lives in the runner that made it: the first that has it."""
        body = await request.body()
        headers = _forwarded_headers(request)
        pool = the_pool()
        for runner in list(pool.runners.values()):
            answer = await pool.client.request(request.method, runner.url + request.url.path,
                                               headers=headers, content=body)  # fmt: skip
            if answer.status_code != 404:
                return Response(answer.content, answer.status_code, _plain(answer))
        return error_response(request.url.path, 404, "no loaded model holds that response "
                              "(a model's stored responses go when it unloads)", "not_found")  # fmt: skip

    async def broadcast(request: Request) -> Response:
        body = await request.body()
        headers = _forwarded_headers(request)
        pool = the_pool()
        answers = [
            await pool.client.request("POST", runner.url + request.url.path, headers=headers,
                                      content=body)
            for runner in list(pool.runners.values())
        ]  # fmt: skip
        if request.url.path == "/abort_request":
            found = next((a for a in answers if a.status_code != 404), None)
            if found is None:
                return error_response(request.url.path, 404, "no unfinished request has that "
                                      "id", "not_found")  # fmt: skip
            return Response(found.content, found.status_code, _plain(found))
        bad = next((a for a in answers if not a.is_success), None)
        if bad is not None:
            return Response(bad.content, bad.status_code, _plain(bad))
        return JSONResponse({"status": "ok", "models": len(answers)})

    async def create(request: Request) -> Response:
        path = request.url.path
        fields = await _json_object(request, config.max_body_bytes)
        if fields is None:
            return error_response(path, 400, "the body must be a JSON object", "invalid_json")
        name = fields.get("model") or fields.get("name")
        if not isinstance(name, str) or not name:
            return error_response(path, 400, "model (the new model's name) is required",
                                  "missing_field")  # fmt: skip
        for unsupported in ("files", "adapters", "quantize"):
            if fields.get(unsupported):
                return error_response(path, 400, f"'{unsupported}' is not supported: create "
                                      "from a model tokenmill models lists, or a path",
                                      "unsupported")  # fmt: skip
        try:
            if isinstance(fields.get("modelfile"), str):  # older clients send the text
                recipe = recipes.parse_modelfile(name, fields["modelfile"])
            elif isinstance(fields.get("from"), str) and fields["from"]:
                recipe = recipes.recipe_from_fields(
                    name, fields["from"], fields.get("system"), fields.get("template"),
                    fields.get("parameters"), fields.get("messages"),
                )  # fmt: skip
            else:
                return error_response(path, 400, "from (the base model) is required",
                                      "missing_field")  # fmt: skip
        except ValueError as e:
            return error_response(path, 400, str(e), "invalid_value")
        if recipe.template is not None and not _is_admin(request, config):
            return error_response(path, 403, "a model with a TEMPLATE is created with the admin "
                                  "key (--admin-api-key)", "admin_only")  # fmt: skip
        pool = the_pool()
        try:
            pool.find(recipe.base)
        except HostError as e:
            return error_response(path, 400, f"from: {e.message}", "model_not_found")
        await asyncio.to_thread(recipes.save, recipe)
        await pool.unload_if_loaded(recipe.name)  # the next request runs the new recipe
        logger.info("created %s (from %s)", recipe.name, recipe.base)
        done = {"status": "success"}
        if fields.get("stream", True) is not False:
            return Response(json.dumps(done) + "\n", media_type="application/x-ndjson")
        return JSONResponse(done)

    async def copy(request: Request) -> Response:
        path = request.url.path
        fields = await _json_object(request, config.max_body_bytes) or {}
        source, destination = fields.get("source"), fields.get("destination")
        if not isinstance(source, str) or not isinstance(destination, str):
            return error_response(path, 400, "source and destination are required",
                                  "missing_field")  # fmt: skip
        try:
            entry = the_pool().find(source)
            await asyncio.to_thread(recipes.copy, entry.name, destination)
        except HostError as e:
            return error_response(path, e.status, e.message, e.code)
        except ValueError as e:
            return error_response(path, 400, str(e), "invalid_value")
        return Response(status_code=200)

    async def delete(request: Request) -> Response:
        path = request.url.path
        fields = await _json_object(request, config.max_body_bytes) or {}
        name = fields.get("model") or fields.get("name")
        if not isinstance(name, str) or not name:
            return error_response(path, 400, "model is required", "missing_field")
        pool = the_pool()
        try:
            entry = pool.find(name)
        except HostError as e:
            return error_response(path, e.status, e.message, e.code)
        try:
            await asyncio.to_thread(recipes.delete, entry.name)
        except ValueError as e:
            return error_response(path, 400, str(e), "invalid_value")
        await pool.unload_if_loaded(entry.name)
        logger.info("deleted %s", entry.name)
        return Response(status_code=200)

    async def openai_models(_: Request) -> JSONResponse:
        cards = [_card(e) for e in _entries(the_pool())]
        return JSONResponse({"object": "list", "data": cards})

    async def openai_model(request: Request) -> JSONResponse:
        try:
            entry = the_pool().find(request.path_params["model_id"])
        except HostError as e:
            return error_response(request.url.path, e.status, e.message, e.code)
        return JSONResponse(_card(entry))

    async def tags(_: Request) -> JSONResponse:
        return JSONResponse({"models": [_tag(e) for e in _entries(the_pool())]})

    async def ps(_: Request) -> JSONResponse:
        pool = the_pool()
        entries = {e.name: e for e in _entries(pool)}
        models = []
        for runner in list(pool.runners.values()):
            item = _tag(entries[runner.name]) if runner.name in entries else {"name": runner.name}
            item["size"] = runner.resident
            item["size_vram"] = 0
            item["expires_at"] = _expiry(pool, runner)
            item["context_length"] = runner.context_length
            models.append(item)
        return JSONResponse({"models": models})

    async def show(request: Request) -> Response:
        path = request.url.path
        fields = await _json_object(request, config.max_body_bytes) or {}
        name = fields.get("model") or fields.get("name")
        try:
            entry = the_pool().find(name if isinstance(name, str) else None)
            recipe = recipes.recipes().get(entry.name) if entry.created else None
        except HostError as e:
            return error_response(path, e.status, e.message, e.code)
        except ValueError as e:
            return error_response(path, 400, str(e), "invalid_value")
        return JSONResponse(_show(entry, recipe))

    async def page(request: Request) -> Response:
        """/dashboard, /docs and their scripts: the host's own (no key, no model loads)."""
        name = pages.PAGES.get(request.url.path) or request.path_params.get("name", "")
        if name not in (*pages.PAGES.values(), *pages.SCRIPTS):
            return error_response(request.url.path, 404, f"no static file {name!r}", "not_found")
        body, media_type = pages.read(name)
        return Response(body, media_type=media_type, headers={"Cache-Control": "no-cache"})

    async def version(_: Request) -> JSONResponse:
        return JSONResponse({"version": __version__})

    async def health(_: Request) -> JSONResponse:
        pool = the_pool()
        loaded = [{"model": r.name, "leases": r.leases, "pid": r.process.pid}
                  for r in pool.runners.values()]  # fmt: skip
        return JSONResponse({"status": "ok", "loaded": loaded})

    async def metrics(_: Request) -> Response:
        pool = the_pool()
        texts = []
        for runner in list(pool.runners.values()):
            with contextlib.suppress(httpx.HTTPError):
                r = await pool.client.get(runner.url + "/metrics", headers=_admin(config))
                if r.status_code == 200:
                    texts.append(r.text)
        return Response(merged_metrics(texts, list(pool.runners)), media_type=CONTENT_TYPE_LATEST)

    routes = [
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/api/version", version),
        *(Route(p, page) for p in (*pages.PAGES, "/static/{name}")),
        Route("/version", version),
        Route("/v1/models", openai_models),
        Route("/v1/models/{model_id:path}", openai_model),
        Route("/api/tags", tags),
        Route("/api/ps", ps),
        Route("/api/show", show, methods=["POST"]),
        Route("/api/create", create, methods=["POST"]),
        Route("/api/copy", copy, methods=["POST"]),
        Route("/api/delete", delete, methods=["DELETE"]),
        *(Route(p, model_route, methods=["POST"]) for p in MODEL_ROUTES),
        *(
            Route(p, default_route, methods=["GET"])
            for p in (*ANY_MODEL_ROUTES, *DEFAULT_MODEL_ROUTES)
        ),
        *(Route(p, each_runner, methods=["GET", "DELETE"]) for p in EACH_RUNNER),
        *(Route(p, broadcast, methods=["POST"]) for p in BROADCAST),
    ]
    app = Starlette(
        routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error}
    )
    app.state.host = holder
    if config.api_keys:
        public = (
            "/health", *pages.PAGES, *(f"/static/{name}" for name in pages.SCRIPTS),
            *(("/metrics",) if config.metrics_public else ()),
        )  # fmt: skip
        app.add_middleware(_KeyCheck, api_keys=config.api_keys, public_paths=public)
    return app


async def _json_object(request: Request, max_bytes: int) -> dict[str, Any] | None:
    try:
        body = await read_body(request, max_bytes)
        fields = json.loads(body)
    except (PayloadTooLarge, ValueError):
        return None
    return fields if isinstance(fields, dict) else None


def _is_admin(request: Request, config: HostConfig) -> bool:
    """Whether the request bears the admin key (a server without keys: anyone may)."""
    if not config.api_keys:
        return True
    if config.admin_api_key is None:
        return False
    auth = request.headers.get("authorization", "")
    presented = auth[7:].strip() if auth.lower().startswith("bearer ") else (
        request.headers.get("x-api-key", "").strip())  # fmt: skip
    return hmac.compare_digest(presented.encode(), config.admin_api_key.encode())


def _loads_only(path: str, fields: dict[str, Any]) -> bool:
    """Ollama's way to load (or, with keep_alive 0, unload) a model: a request with nothing
    to answer."""
    if path == "/api/generate":
        return not fields.get("prompt") and not fields.get("images")
    if path == "/api/chat":
        return not fields.get("messages")
    return False


async def _load_or_unload(pool: RunnerPool, name: object, keep_alive: float | None) -> Response:
    model = name if isinstance(name, str) else None
    if keep_alive == 0:
        await pool.unload(model)
        reason = "unload"
    else:
        await pool.load(model, keep_alive)
        reason = "load"
    now = datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")
    return JSONResponse({"model": model or pool.config.default_model, "created_at": now,
                         "response": "", "done": True, "done_reason": reason})  # fmt: skip


async def _forward(
    runner: Runner,
    request: Request,
    body: bytes,
    release: Callable[[], None],
    set_headers: dict[str, str] | None = None,
) -> Response:
    """Proxy to the runner; its lease ends (``release``) with the response (a stream: when it
    closes)."""
    try:
        response = await runner.proxy.forward(request, routed=False, body=body,
                                              set_headers=set_headers)  # fmt: skip
    except BaseException:
        release()
        raise
    if not isinstance(response, ProxyResponse):
        release()
        return response
    response.also_on_close(release)
    return response


def _forwarded_headers(request: Request) -> list[tuple[bytes, bytes]]:
    skip = {b"host", b"content-length", b"connection", b"transfer-encoding", b"accept-encoding"}
    return [(k, v) for k, v in request.headers.raw if k.lower() not in skip]


def _plain(answer: httpx.Response) -> dict[str, str]:
    dropped = {"content-length", "transfer-encoding", "connection", "date", "server",
               "content-encoding"}  # fmt: skip
    return {k: v for k, v in answer.headers.items() if k.lower() not in dropped}


def _admin(config: HostConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {config.api_keys[0]}"} if config.api_keys else {}


def _entries(pool: RunnerPool) -> list[Entry]:
    return [e for e in pool.models() if servable(e)]


def _card(entry: Entry) -> dict[str, Any]:
    context = entry.summary.context_length if entry.summary is not None else None
    return {"id": entry.name, "object": "model", "created": 0, "owned_by": "tokenmill",
            "max_model_len": context}  # fmt: skip


def _tag(entry: Entry) -> dict[str, Any]:
    s = entry.summary
    identity = f"{entry.path}:{s.file_bytes if s else 0}"
    return {
        "name": f"{entry.name}:latest",
        "model": f"{entry.name}:latest",
        "modified_at": _modified(entry),
        "size": s.file_bytes if s is not None else 0,
        "digest": hashlib.sha256(identity.encode()).hexdigest(),
        "details": {
            "parent_model": "",
            "format": "gguf" if s is not None and s.format == "gguf" else "safetensors",
            "family": s.architecture if s is not None else "",
            "families": [s.architecture] if s is not None else [],
            "parameter_size": parameter_size(s.num_parameters) if s is not None else "",
            "quantization_level": (s.file_type or "F32") if s is not None else "",
        },
    }


def _show(entry: Entry, recipe: recipes.Recipe | None) -> dict[str, Any]:
    """Ollama's /api/show of a model, from its files' headers and its Modelfile."""
    s = entry.summary
    template = (recipe.template if recipe is not None else None) or (
        s.chat_template if s is not None else None) or ""  # fmt: skip
    capabilities = ["completion", *(["tools"] if "tools" in template else [])]
    info: dict[str, Any] = {}
    if s is not None:
        info = {"general.architecture": s.architecture,
                "general.parameter_count": s.num_parameters,
                f"{s.architecture}.context_length": s.context_length}  # fmt: skip
    return {
        "license": "",
        **recipes.show_fields(recipe, str(entry.path)),
        "template": template,
        "details": _tag(entry)["details"],
        "model_info": info,
        "capabilities": capabilities,
        "modified_at": _modified(entry),
    }


def _modified(entry: Entry) -> str:
    when = datetime.datetime.now(datetime.UTC)
    if entry.path is not None:
        with contextlib.suppress(OSError):
            when = datetime.datetime.fromtimestamp(entry.path.stat().st_mtime, datetime.UTC)
    return when.isoformat().replace("+00:00", "Z")


def _expiry(pool: RunnerPool, runner: Runner) -> str:
    if runner.expires is None:
        return FOREVER
    left = max(runner.expires - pool.clock(), 0.0)
    when = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=left)
    return when.isoformat().replace("+00:00", "Z")
