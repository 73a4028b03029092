"""/openapi.json (server/openapi.py) against the app it describes: every route is in it with
its request body and response schema; real requests validate against the request schemas and
real answers (JSON, SSE events, NDJSON lines, errors) against the response schemas; /docs
renders it in a browser. Fuzzing against it is tests/reliability/test_fuzz_openapi.py."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest
from browser import browser_context, requires_chromium
from fastapi.routing import APIRoute
from live_server import MODEL_NAME, running_server

KEY, ADMIN = "sk-schema", "sk-schema-admin"
AUTH = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with running_server(tiny_model_dir("llama"), api_keys=(KEY,), admin_api_key=ADMIN) as srv:
        yield srv


@pytest.fixture(scope="module")
def doc(server) -> dict[str, Any]:
    r = httpx.get(f"{server.url}/openapi.json", headers=AUTH)
    assert r.status_code == 200
    return r.json()


def _validator(doc: dict[str, Any], schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    # "#/components/..." refs resolve against a root that holds the document's components.
    return jsonschema.Draft202012Validator({**schema, "components": doc["components"]})


def _op(doc: dict[str, Any], method: str, path: str) -> dict[str, Any]:
    return doc["paths"][path][method.lower()]


def _request_schema(doc, method, path) -> dict[str, Any]:
    return _op(doc, method, path)["requestBody"]["content"]["application/json"]["schema"]


def _response_schema(doc, method, path, media="application/json", status="200") -> dict:
    content = _op(doc, method, path)["responses"][status]["content"][media]
    return content.get("x-item-schema", content["schema"])


def test_schema_needs_the_key(server) -> None:
    r = httpx.get(f"{server.url}/openapi.json")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/openapi.json", headers={"X-Api-Key": KEY}).status_code == 200


def test_every_route_is_described_with_its_bodies(server, doc) -> None:
    routes = [r for r in server.app.routes if isinstance(r, APIRoute)]
    assert len(routes) >= 20
    schemas = doc["components"]["schemas"]
    described = {(m.upper(), p) for p, item in doc["paths"].items() for m in item}
    in_app = {(m, r.path_format) for r in routes for m in r.methods}
    assert described == in_app
    for method, path in in_app:
        op = _op(doc, method, path)
        assert op["summary"], (method, path)
        ok = op["responses"]["200"]["content"]
        assert ok, (method, path)
        for content in ok.values():
            schema = content.get("x-item-schema", content["schema"])
            ref = schema.get("$ref")
            if ref is not None:
                assert ref.split("/")[-1] in schemas, (method, path, ref)
        for status in ("4XX", "5XX"):
            assert op["responses"][status]["content"]["application/json"]["schema"]["$ref"]
        if method == "POST" and path != "/reset_prefix_cache":
            name = _request_schema(doc, method, path)["$ref"].split("/")[-1]
            assert schemas[name]["properties"], name
        public = path in ("/health", "/dashboard", "/docs", "/static/{name}")
        assert op["security"] == ([] if public else [{"bearer": []}, {"apiKey": []}])
    # The protocol models' own constraints are in it: strict bodies, required fields.
    completion = schemas["CompletionRequest"]
    assert completion["additionalProperties"] is False and completion["required"] == ["prompt"]
    assert "ChatCompletionChunk" in schemas and "UsageReport" in schemas
    params = {p["name"] for p in _op(doc, "GET", "/v1/usage")["parameters"]}
    assert params == {"key", "key_id", "user", "since", "until", "group_by"}


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=60)


REQUESTS = {
    "/v1/completions": {"model": MODEL_NAME, "prompt": ["a", "b"], "max_tokens": 3,
                        "logprobs": 1, "n": 2},
    "/v1/chat/completions": {"model": MODEL_NAME, "max_tokens": 3, "logprobs": True,
                             "top_logprobs": 1,
                             "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 3},
    "/tokenize": {"messages": [{"role": "user", "content": "hi"}]},
    "/detokenize": {"tokens": [40, 41]},
    "/api/chat": {"model": MODEL_NAME, "stream": False,
                  "messages": [{"role": "user", "content": "hi"}],
                  "options": {"num_predict": 3}},
    "/api/generate": {"model": MODEL_NAME, "prompt": "hi", "stream": False,
                      "options": {"num_predict": 3}},
    "/api/show": {"model": MODEL_NAME},
}  # fmt: skip


@pytest.mark.parametrize("path", sorted(REQUESTS))
def test_requests_and_answers_match_the_schema(server, doc, path) -> None:
    body = REQUESTS[path]
    _validator(doc, _request_schema(doc, "POST", path)).validate(body)
    r = _post(server, path, body)
    assert r.status_code == 200, r.text
    _validator(doc, _response_schema(doc, "POST", path)).validate(r.json())


@pytest.mark.parametrize(
    "path", ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize",
             "/api/chat", "/api/generate", "/api/show"],
)  # fmt: skip
def test_request_examples_are_valid_and_served(server, doc, path) -> None:
    """Each POST route documents an example body (schemathesis' examples phase starts from
    them): it is valid by the schema and the server answers it with 200."""
    body = _op(doc, "POST", path)["requestBody"]["content"]["application/json"]["example"]
    _validator(doc, _request_schema(doc, "POST", path)).validate(body)
    r = _post(server, path, body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "path",
    ["/v1/models", f"/v1/models/{MODEL_NAME}", "/health", "/version", "/v1/usage",
     "/v1/stats", "/api/tags", "/api/ps", "/api/version"],
)  # fmt: skip
def test_get_answers_match_the_schema(server, doc, path) -> None:
    r = httpx.get(f"{server.url}{path}", headers=AUTH)
    assert r.status_code == 200, r.text
    template = "/v1/models/{model_id}" if path.startswith("/v1/models/") else path
    _validator(doc, _response_schema(doc, "GET", template)).validate(r.json())


def test_streamed_events_match_their_item_schema(server, doc) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = REQUESTS[path] | {"stream": True, "stream_options": {"include_usage": True}}
        validator = _validator(doc, _response_schema(doc, "POST", path, "text/event-stream"))
        # The stream's own schema is one event (OpenAPI 3.1 tools, schemathesis, read it so).
        event_schema = _op(doc, "POST", path)["responses"]["200"]["content"]["text/event-stream"]
        event_validator = _validator(doc, event_schema["schema"])
        events = 0
        with httpx.stream("POST", f"{server.url}{path}", json=body, headers=AUTH) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    event_validator.validate({"data": line[6:], "event": "message"})
                if line.startswith("data: {"):
                    validator.validate(json.loads(line[6:]))
                    events += 1
        assert events >= 3
    for path in ("/api/chat", "/api/generate"):
        body = REQUESTS[path] | {"stream": True}
        validator = _validator(doc, _response_schema(doc, "POST", path, "application/x-ndjson"))
        with httpx.stream("POST", f"{server.url}{path}", json=body, headers=AUTH) as r:
            lines = [json.loads(line) for line in r.iter_lines() if line]
        assert len(lines) >= 2 and lines[-1]["done"] is True
        for line in lines:
            validator.validate(line)


def test_errors_match_the_schema(server, doc) -> None:
    r = _post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": "x", "n": 0})
    assert r.status_code == 400
    _validator(doc, _response_schema(doc, "POST", "/v1/completions", status="4XX")).validate(
        r.json()
    )
    r = _post(server, "/api/generate", {"model": "nope", "prompt": "x"})
    assert r.status_code == 404
    schema = _response_schema(doc, "POST", "/api/generate", status="4XX")
    _validator(doc, schema).validate(r.json())
    with pytest.raises(jsonschema.ValidationError):  # the two error shapes differ
        _validator(doc, _response_schema(doc, "GET", "/v1/models", status="4XX")).validate(r.json())


@requires_chromium
def test_docs_page_lists_every_operation(server, doc, tmp_path) -> None:
    with browser_context(tmp_path) as browser:
        page = browser.new_page()
        page.goto(f"{server.url}/docs")
        page.wait_for_selector("#key-form.shown", timeout=10_000)
        page.fill("#api-key", KEY)
        page.click("#save-key")
        page.wait_for_function("window.tokenmillDocs !== undefined", timeout=10_000)
        ops = page.eval_on_selector_all(".op", "nodes => nodes.map(n => n.id)")
        want = {f"op-{m}-{p}" for p, item in doc["paths"].items() for m in item}
        assert set(ops) == want
        assert page.is_visible("#model-CompletionRequest")
