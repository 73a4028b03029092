"""Prefix caching as an API user sees it: cached_tokens in usage, cache_salt, the admin reset."""

from __future__ import annotations

import httpx
import pytest
from live_server import running_server

KEY = "admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# 40 byte-level tokens of prompt: with 16-token blocks, 2 full blocks (32 tokens) are cacheable.
PROMPT = "The same long system prompt, then: hi!"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with running_server(tiny_model_dir("llama"), api_keys=(KEY,)) as s:
        yield s


def _complete(url: str, **extra) -> dict:
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 2, "temperature": 0} | extra
    r = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def _cached(resp: dict) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cached_tokens_in_usage_and_reset(server) -> None:
    r = httpx.post(f"{server.url}/reset_prefix_cache", headers=AUTH)
    assert r.status_code == 200 and r.json() == {"reset": True}
    first = _complete(server.url)
    second = _complete(server.url)
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert _cached(first) == 0
    assert _cached(second) == (prompt_tokens - 1) // 16 * 16 > 0
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert httpx.post(f"{server.url}/reset_prefix_cache", headers=AUTH).json() == {"reset": True}
    assert _cached(_complete(server.url)) == 0
    server.wait_idle()


def test_cache_salt_isolates(server) -> None:
    _complete(server.url, cache_salt="tenant-a")
    assert _cached(_complete(server.url, cache_salt="tenant-b")) == 0
    assert _cached(_complete(server.url, cache_salt="tenant-a")) > 0
    server.wait_idle()


def test_reset_needs_the_key(server) -> None:
    r = httpx.post(f"{server.url}/reset_prefix_cache")
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"


def test_reset_route_absent_without_api_key(tiny_model_dir) -> None:
    with running_server(tiny_model_dir("llama")) as s:
        r = httpx.post(f"{s.url}/reset_prefix_cache")
        assert r.status_code == 404
        assert "api-key" in r.json()["error"]["message"]
