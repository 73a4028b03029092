"""Security through a real server on loopback (the tiny random-weight Llama), issue 26: the API
key on every route but the open ones (enumerated from the app, so a new route without the key
fails here), /metrics behind the key unless ``--metrics-public``, the admin key for control
routes, keys compared in constant time over every configured key, the body cap, templates sent
in requests refused, prefix-cache isolation by ``cache_salt`` read from /metrics counters, and
127.0.0.1 as the default bind address."""

from __future__ import annotations

import hashlib
import hmac
import json
import sys
from pathlib import Path

import httpx
import pytest
from fastapi.routing import APIRoute

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from live_server import MODEL_NAME, running_server, scrape  # noqa: E402

from tokenmill.cli import build_parser  # noqa: E402
from tokenmill.server import auth  # noqa: E402
from tokenmill.server.auth import APIKeyMiddleware, key_id_of  # noqa: E402
from tokenmill.server.config import ServerConfig  # noqa: E402

KEY, OTHER_KEY, ADMIN = "sk-user-0123456789", "sk-user-other-000", "sk-admin-0123456789"
MAX_BODY = 8192
# The routes that need no key: /health, and the pages that hold no data (their scripts ask the
# user for the key and send it to the data routes). Anything else found in the app needs one.
OPEN_ROUTES = {"/health", "/dashboard", "/docs", "/static/{name}"}
PATH_PARAMS = {"{model_id}": MODEL_NAME, "{name}": "dashboard.js", "{response_id}": "resp-x"}
# About 100 byte-level tokens: several full 16-token blocks to cache.
LONG_PROMPT = "A long shared system prompt that two tenants both send, word for word: " + "x" * 25
BLOCK_SIZE = 16


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with running_server(
        tiny_model_dir("llama"),
        api_keys=(KEY, OTHER_KEY),
        admin_api_key=ADMIN,
        max_body_bytes=MAX_BODY,
    ) as srv:
        yield srv


def _routes(app) -> list[tuple[str, str, str]]:
    """(method, path template, concrete path) of every route of the app."""
    out = []
    for route in app.routes:
        if not isinstance(route, APIRoute):
            continue
        path = route.path_format
        for name, value in PATH_PARAMS.items():
            path = path.replace(name, value)
        assert "{" not in path, f"no value for the parameter of {route.path_format}"
        out += [(method, route.path_format, path) for method in sorted(route.methods)]
    return out


def _send(server, method: str, path: str, headers: dict[str, str]) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1} if method == "POST" else None
    return httpx.request(method, f"{server.url}{path}", json=body, headers=headers, timeout=30)


# ---- the key on every route ------------------------------------------------------------------


def test_every_route_but_the_open_ones_needs_the_key(server) -> None:
    routes = _routes(server.app)
    templates = {template for _, template, _ in routes}
    # The enumeration sees the routes this test is about; a new one is covered without edits.
    for expected in ("/tokenize", "/detokenize", "/reset_prefix_cache", "/v1/usage",
                     "/v1/stats", "/openapi.json", "/metrics", "/api/chat", "/api/tags",
                     "/api/version", "/v1/models/{model_id}"):  # fmt: skip
        assert expected in templates, expected
    assert templates >= OPEN_ROUTES
    wrong = [
        {},
        _auth("sk-wrong"),
        {"X-Api-Key": "sk-wrong"},
        {"Authorization": KEY},  # no scheme
        {"Authorization": f"Basic {KEY}"},
        _auth(KEY[:-1]),  # a prefix of a key
        _auth(KEY + "0"),  # a key with more after it
    ]
    for method, template, path in routes:
        for headers in wrong:
            r = _send(server, method, path, headers)
            if template in OPEN_ROUTES:
                assert r.status_code != 401, (method, path, headers)
            else:
                assert r.status_code == 401, (method, path, headers, r.status_code)
                error = r.json()["error"]
                # Ollama's error is the message; Anthropic's has a type and a message
                if path.startswith("/api/"):
                    code = error
                elif path.startswith("/v1/messages"):
                    code = error["message"]
                else:
                    code = error["code"]
                assert "invalid_api_key" in code or "API key" in code, (method, path)
                assert r.headers["www-authenticate"] == "Bearer"
        # With a key the route answers (what it answers depends on the route).
        r = _send(server, method, path, _auth(ADMIN))
        assert r.status_code not in (401, 500), (method, path, r.text[:200])
    # An unknown route is 401 too: nobody without a key learns which routes exist.
    assert httpx.get(f"{server.url}/v1/nothing-here").status_code == 401
    assert httpx.get(f"{server.url}/v1/nothing-here", headers=_auth(KEY)).status_code == 404


def test_open_pages_hold_no_data(server) -> None:
    """The open pages are the package's static files: no figure, model name or key in them."""
    for path in ("/dashboard", "/docs", "/static/dashboard.js", "/static/docs.js"):
        r = httpx.get(f"{server.url}{path}")
        assert r.status_code == 200
        assert MODEL_NAME not in r.text and KEY not in r.text and ADMIN not in r.text


def test_the_openapi_document_says_which_routes_need_the_key(server) -> None:
    doc = httpx.get(f"{server.url}/openapi.json", headers=_auth(KEY)).json()
    for path, item in doc["paths"].items():
        for op in item.values():
            assert (op["security"] == []) == (path in OPEN_ROUTES), path


# ---- /metrics ----------------------------------------------------------------------------------


def test_metrics_need_the_key_by_default(server) -> None:
    assert httpx.get(f"{server.url}/metrics").status_code == 401
    r = httpx.get(f"{server.url}/metrics", headers=_auth(KEY))
    assert r.status_code == 200 and "tokenmill:prefix_cache_hits_total" in r.text


def test_metrics_public_opens_metrics_alone(tiny_model_dir) -> None:
    with running_server(tiny_model_dir("llama"), api_keys=(KEY,), metrics_public=True) as srv:
        r = httpx.get(f"{srv.url}/metrics")
        assert r.status_code == 200 and "tokenmill:num_requests_running" in r.text
        for method, template, path in _routes(srv.app):
            if template not in OPEN_ROUTES and template != "/metrics":
                assert _send(srv, method, path, {}).status_code == 401, (method, path)
        doc = httpx.get(f"{srv.url}/openapi.json", headers=_auth(KEY)).json()
        assert doc["paths"]["/metrics"]["get"]["security"] == []
        assert doc["paths"]["/tokenize"]["post"]["security"] != []


def test_metrics_public_flag() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve", "m"]).metrics_public is False
    assert parser.parse_args(["serve", "m", "--metrics-public"]).metrics_public is True
    assert ServerConfig(served_model_name="m").metrics_public is False


def test_serve_passes_metrics_public_to_the_server(monkeypatch) -> None:
    import tokenmill.server.launcher as launcher
    from tokenmill.cli import main

    seen: list[ServerConfig] = []
    monkeypatch.setattr(launcher, "run_server", lambda args, config, level: seen.append(config))
    main(["serve", "some/model", "--metrics-public", "--api-key", KEY])
    main(["serve", "some/model", "--api-key", KEY])
    assert [c.metrics_public for c in seen] == [True, False]
    assert seen[1].host == "127.0.0.1"


# ---- the admin key ---------------------------------------------------------------------------


def test_control_routes_need_the_admin_key(server) -> None:
    r = httpx.post(f"{server.url}/reset_prefix_cache", headers=_auth(KEY))
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
    r = httpx.post(f"{server.url}/reset_prefix_cache", headers=_auth(ADMIN))
    assert r.status_code == 200 and r.json() == {"reset": True}
    other = key_id_of(OTHER_KEY)
    r = httpx.get(f"{server.url}/v1/usage", params={"key_id": other}, headers=_auth(KEY))
    assert r.status_code == 403
    r = httpx.get(f"{server.url}/v1/usage", params={"key": OTHER_KEY}, headers=_auth(KEY))
    assert r.status_code == 403
    r = httpx.get(f"{server.url}/v1/usage", params={"key_id": key_id_of(KEY)}, headers=_auth(KEY))
    assert r.status_code == 200
    r = httpx.get(f"{server.url}/v1/usage", params={"key_id": other}, headers=_auth(ADMIN))
    assert r.status_code == 200


# ---- constant-time comparison ------------------------------------------------------------------


def _near_misses(key: str) -> list[str]:
    """Keys of the same length that differ from ``key`` in one byte: its last, its first."""
    flip = {"0": "1"}

    def other(c: str) -> str:
        return flip.get(c, "0")

    return [key[:-1] + other(key[-1]), other(key[0]) + key[1:]]


def test_near_miss_keys_are_refused(server) -> None:
    for key in (KEY, OTHER_KEY, ADMIN):
        for near in _near_misses(key):
            assert len(near) == len(key) and near != key
            for headers in (_auth(near), {"X-Api-Key": near}):
                r = httpx.get(f"{server.url}/v1/models", headers=headers)
                assert r.status_code == 401, (key, near)
        assert httpx.get(f"{server.url}/v1/models", headers=_auth(key)).status_code == 200


def _scope(headers: dict[str, str]) -> dict:
    return {
        "type": "http",
        "path": "/v1/models",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }


def test_every_key_is_compared_as_a_digest_in_constant_time(monkeypatch) -> None:
    """Whatever key comes (right, wrong, a near miss of the first or last configured key),
    hmac.compare_digest runs once per configured key on SHA-256 digests, never on the keys."""
    calls: list[tuple[bytes, bytes]] = []
    compare = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    keys = ("sk-first-key-aaaa", "sk-middle-key-bb", "sk-last-key-cccc")
    mw = APIKeyMiddleware(app=None, api_keys=keys, admin_api_key=ADMIN)  # type: ignore[arg-type]
    digests = {hashlib.sha256(k.encode()).digest() for k in (*keys, ADMIN)}
    presented = [*keys, ADMIN, "nope", *_near_misses(keys[0]), *_near_misses(keys[-1])]
    for key in presented:
        for headers in (_auth(key), {"X-Api-Key": key}):
            calls.clear()
            caller = mw._caller(_scope(headers))
            assert len(calls) == 4, (key, len(calls))  # no early exit on a match
            sent = hashlib.sha256(key.encode()).digest()
            assert all(a == sent and b in digests for a, b in calls)
            assert {b for _, b in calls} == digests
            if key in keys:
                assert caller is not None and not caller.is_admin
                assert caller.key_id == key_id_of(key)
            elif key == ADMIN:
                assert caller is not None and caller.is_admin
            else:
                assert caller is None
    calls.clear()
    assert mw._caller(_scope({})) is None and calls == []  # nothing presented: nothing compared


# ---- body size -------------------------------------------------------------------------------


def _exact_body(size: int) -> bytes:
    """A valid completion request of exactly ``size`` bytes (JSON allows trailing spaces)."""
    body = json.dumps({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}).encode()
    assert len(body) <= size
    return body + b" " * (size - len(body))


def _assert_openai_413(r: httpx.Response) -> None:
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "request_too_large" and str(MAX_BODY) in error["message"]
    assert error["type"] == "invalid_request_error"


def test_body_at_the_cap_is_read_one_byte_over_is_413(server) -> None:
    url = f"{server.url}/v1/completions"
    headers = _auth(KEY) | {"Content-Type": "application/json"}
    assert httpx.post(url, content=_exact_body(MAX_BODY), headers=headers).status_code == 200
    _assert_openai_413(httpx.post(url, content=_exact_body(MAX_BODY + 1), headers=headers))

    def chunked(size: int):  # no Content-Length: the cap applies while the body is read
        body = _exact_body(size)
        for start in range(0, len(body), 1000):
            yield body[start : start + 1000]

    r = httpx.post(url, content=chunked(MAX_BODY), headers=headers)
    assert r.status_code == 200 and "content-length" not in r.request.headers
    r = httpx.post(url, content=chunked(MAX_BODY + 1), headers=headers)
    assert "content-length" not in r.request.headers
    _assert_openai_413(r)
    # Ollama's routes answer in Ollama's error shape.
    r = httpx.post(f"{server.url}/api/generate", content=chunked(MAX_BODY + 1), headers=headers)
    assert r.status_code == 413 and str(MAX_BODY) in r.json()["error"]
    server.wait_idle()


# ---- templates in requests -------------------------------------------------------------------

_MESSAGES = [{"role": "user", "content": "hi"}]
# A template that would reach Python internals if it were rendered unsandboxed.
_HOSTILE = "{{ ''.__class__.__mro__[1].__subclasses__() }}"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": _MESSAGES, "chat_template": _HOSTILE},
         "chat_template"),
        ("/v1/chat/completions", {"messages": _MESSAGES, "chat_template": ""}, "chat_template"),
        # Only plain values a template reads (enable_thinking, ...) pass, never a template.
        ("/v1/chat/completions",
         {"messages": _MESSAGES, "chat_template_kwargs": {"tools_template": _HOSTILE}},
         "chat_template_kwargs.tools_template"),
        ("/tokenize", {"messages": _MESSAGES, "chat_template": _HOSTILE}, "chat_template"),
        ("/tokenize", {"messages": _MESSAGES, "chat_template_kwargs": {}},
         "chat_template_kwargs"),
    ],
)  # fmt: skip
def test_templates_in_openai_requests_are_refused(server, path, body, param) -> None:
    r = httpx.post(f"{server.url}{path}", json={"model": MODEL_NAME} | body, headers=_auth(KEY))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] in ("unsupported", "unknown_field")
    assert "refused" in error["message"] or "not part of" in error["message"]


@pytest.mark.parametrize("path", ["/api/generate", "/api/chat"])
def test_templates_in_ollama_requests_are_refused(server, path) -> None:
    body = {"model": MODEL_NAME, "prompt": "hi", "messages": _MESSAGES, "template": _HOSTILE,
            "stream": False}  # fmt: skip
    r = httpx.post(f"{server.url}{path}", json=body, headers=_auth(KEY))
    assert r.status_code == 400, r.text
    assert "'template' is not supported" in r.json()["error"]


# ---- prefix-cache isolation ------------------------------------------------------------------


def _hits(server) -> float:
    server.wait_idle()
    return scrape(server.url, _auth(KEY))["tokenmill:prefix_cache_hits_total"]


def _complete(server, salt: str | None) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) of a completion of LONG_PROMPT."""
    body = {"model": MODEL_NAME, "prompt": LONG_PROMPT, "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=_auth(KEY), timeout=30)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def test_cache_salt_isolates_prefix_hits_by_the_counters(server) -> None:
    assert httpx.post(f"{server.url}/reset_prefix_cache", headers=_auth(ADMIN)).json()["reset"]
    hits = _hits(server)
    steps = []
    for salt in ("tenant-a", "tenant-b", None, "tenant-a", "tenant-b", None):
        prompt_tokens, cached = _complete(server, salt)
        now = _hits(server)
        steps.append((salt, cached, now - hits))
        hits = now
    # Each salt's first request hits nothing of the others' blocks; its second hits its own
    # full blocks (the last prompt token is always computed).
    cacheable = (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert cacheable >= 4 * BLOCK_SIZE
    salts = ("tenant-a", "tenant-b", None)
    assert steps == [(s, 0, 0) for s in salts] + [(s, cacheable, cacheable) for s in salts]


# ---- bind address ----------------------------------------------------------------------------


def test_loopback_is_the_default_bind_address() -> None:
    assert ServerConfig(served_model_name="m").host == "127.0.0.1"
    assert build_parser().parse_args(["serve", "m"]).host == "127.0.0.1"
    assert build_parser().parse_args(["serve", "m", "--host", "0.0.0.0"]).host == "0.0.0.0"
