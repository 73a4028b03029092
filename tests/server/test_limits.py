"""Per-key rate limits (server/limits.py): the sliding window on a fake clock, and 429 with
Retry-After from a real server."""

from __future__ import annotations

import httpx
import pytest
from live_server import MODEL_NAME, running_server

from tokenmill.server.auth import key_id_of
from tokenmill.server.errors import APIError
from tokenmill.server.limits import RateLimiter

KEY_A, KEY_B, ADMIN = "sk-a", "sk-b", "sk-admin"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_requests_per_minute_slide() -> None:
    clock = Clock()
    limiter = RateLimiter(rpm=2, tpm=None, clock=clock)
    limiter.admit("a")
    clock.now += 10
    limiter.admit("a")
    limiter.admit("b")  # another key has its own window
    clock.now += 5
    with pytest.raises(APIError) as exc:
        limiter.admit("a")
    assert exc.value.status == 429 and exc.value.code == "rate_limit_requests"
    assert exc.value.headers == {"Retry-After": "45"}  # the first falls out at 1060
    clock.now = 1060.0
    limiter.admit("a")  # refused requests were not counted
    with pytest.raises(APIError):
        limiter.admit("a")


def test_tokens_per_minute_slide() -> None:
    clock = Clock()
    limiter = RateLimiter(rpm=None, tpm=100, clock=clock)
    limiter.admit("a")
    limiter.add_tokens("a", 60)
    clock.now += 20
    limiter.admit("a")  # 60 < 100
    limiter.add_tokens("a", 50)
    clock.now += 1
    with pytest.raises(APIError) as exc:
        limiter.admit("a")
    assert exc.value.code == "rate_limit_tokens"
    assert "110 tokens" in exc.value.message
    # Below the limit once the first 60 fall out of the window, at 1060.
    assert exc.value.headers == {"Retry-After": "39"}
    clock.now = 1060.0
    limiter.admit("a")


def _complete(url: str, key: str, max_tokens: int = 4) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": "rate me", "max_tokens": max_tokens,
            "ignore_eos": True}  # fmt: skip
    return httpx.post(
        f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    )


def test_over_the_limit_is_429_with_retry_after(tiny_model_dir) -> None:
    with running_server(
        tiny_model_dir("llama"),
        api_keys=(KEY_A, KEY_B),
        admin_api_key=ADMIN,
        rate_limit_rpm=2,
        rate_limit_tpm=40,
    ) as server:
        assert _complete(server.url, KEY_A).status_code == 200
        assert _complete(server.url, KEY_A).status_code == 200
        r = _complete(server.url, KEY_A)
        assert r.status_code == 429
        assert 1 <= int(r.headers["Retry-After"]) <= 60
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_requests")
        assert "2 a minute" in error["message"]
        # Key B: one request of 8 + 40 tokens is over its 40 tokens a minute; the next waits.
        assert _complete(server.url, KEY_B, max_tokens=40).status_code == 200
        r = _complete(server.url, KEY_B)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_tokens"
        assert 1 <= int(r.headers["Retry-After"]) <= 60
        # The admin key is not limited; refused requests are not metered.
        for _ in range(3):
            assert _complete(server.url, ADMIN).status_code == 200
        usage = httpx.get(
            f"{server.url}/v1/usage",
            params={"group_by": "key"},
            headers={"Authorization": f"Bearer {ADMIN}"},
        ).json()
        requests = {row["key_id"]: row["requests"] for row in usage["data"]}
        assert requests == {key_id_of(KEY_A): 2, key_id_of(KEY_B): 1, key_id_of(ADMIN): 3}
