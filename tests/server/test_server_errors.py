"""Every 4xx / 503 through raw HTTP, with its OpenAI-style body; nothing leaks afterwards."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from conftest import fail_steps_after
from live_server import MODEL_NAME, LiveServer, running_server, tiny_engine_args

from tokenmill.engine.async_engine import AsyncEngine

KEYS = ("key-one", "key-two")
AUTH = {"Authorization": f"Bearer {KEYS[0]}"}
MAX_BODY = 4096


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    # One running sequence and one waiting: the third request in flight gets 429.
    with running_server(
        tiny_model_dir("llama"),
        engine_overrides={"max_num_seqs": 1},
        api_keys=KEYS,
        max_queue=1,
        max_n=2,
        max_stop=2,
        max_tokens=200,
        max_prompts=2,
        max_body_bytes=MAX_BODY,
    ) as srv:
        yield srv
    # Whatever failed above, no request may be left in the engine nor in admission.
    assert srv.state.num_admitted == 0


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as client:
        yield client


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert isinstance(body["error"]["code"], str) and body["error"]["code"]
    return body["error"]


def _chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], **fields}


def _completion(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, **fields}


@pytest.mark.parametrize(
    ("path", "body", "param", "needle"),
    [
        ("/v1/completions", _completion(temperature=3.0), "temperature", "[0.0, 2.0]"),
        ("/v1/completions", _completion(top_p=0.0), "top_p", "(0, 1]"),
        ("/v1/completions", _completion(n=3), "n", "[1, 2]"),
        ("/v1/completions", _completion(max_tokens=201), "max_tokens", "[1, 200]"),
        ("/v1/completions", _completion(max_tokens=0), "max_tokens", "[1, 200]"),
        ("/v1/completions", _completion(presence_penalty=2.5), "presence_penalty", "[-2.0, 2.0]"),
        ("/v1/completions", _completion(logprobs=21), "logprobs", "[0, 20]"),
        ("/v1/completions", _completion(stop=["a", "b", "c"]), "stop", "at most 2"),
        ("/v1/completions", _completion(stop=[""]), "stop", "non-empty"),
        ("/v1/completions", _completion(top_k=0), "top_k", "-1"),
        ("/v1/completions", _completion(min_tokens=5), "min_tokens", "max_tokens"),
        ("/v1/completions", _completion(seed=2**64), "seed", "2**63"),
        ("/v1/completions", _completion(logit_bias={"abc": 1}), "logit_bias", "token ids"),
        ("/v1/completions", _completion(logit_bias={"5": 101}), "logit_bias", "[-100, 100]"),
        ("/v1/completions", _completion(logit_bias={"100000": 1}), "logit_bias", "[0, 384)"),
        ("/v1/completions", _completion(stop_token_ids=[100000]), "stop_token_ids", "[0, 384)"),
        ("/v1/completions", _completion(prompt=[1, 99999]), "prompt", "[0, 384)"),
        ("/v1/completions", _completion(prompt=""), "prompt", "empty"),
        ("/v1/completions", _completion(prompt=["a", "b", "c"]), "prompt", "at most 2"),
        # echo with logprobs scores the prompt (test_server_scoring.py); max_tokens 0 only so
        ("/v1/completions", _completion(max_tokens=0, echo=False), "max_tokens", "[1, 200]"),
        ("/v1/completions", _completion(suffix="x"), "suffix", "not supported"),
        ("/v1/completions", _completion(best_of=2), "best_of", "n"),
        ("/v1/chat/completions", _chat(top_logprobs=2), "top_logprobs", "logprobs"),
        ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=30), "top_logprobs", "20"),
        ("/v1/chat/completions", _chat(max_completion_tokens=300), "max_completion_tokens", "200"),
        ("/v1/chat/completions", _chat(tools=[{"type": "function"}]), "tools", "tools[0]"),
        ("/v1/chat/completions", _chat(chat_template="{{ 1 }}"), "chat_template", "refused"),
        (
            "/v1/chat/completions",
            _chat(response_format={"type": "yaml"}),
            "response_format",
            "response_format type must be",
        ),
        (
            "/v1/chat/completions",
            _chat(messages=[{"role": "tool", "content": "x"}]),
            "messages",
            "role",
        ),
        (
            "/v1/chat/completions",
            _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            "messages",
            "only text",
        ),
        ("/v1/chat/completions", _chat(stream_options={"include_usage": True}), "stream_options", "stream"),
    ],
)  # fmt: skip
def test_invalid_fields_400(http, path, body, param, needle) -> None:
    err = _error(http.post(path, json=body), 400)
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"
    assert needle in err["message"], err["message"]


def test_context_overflow_400_gives_both_numbers(http) -> None:
    prompt = "x" * 200
    num_prompt = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
    err = _error(http.post("/v1/completions", json=_completion(prompt=prompt, max_tokens=64)), 400)
    assert err["code"] == "context_length_exceeded"
    assert err["param"] == "max_tokens"
    assert f"{num_prompt} tokens" in err["message"] and "(64)" in err["message"]
    assert "256" in err["message"]
    err = _error(
        http.post("/v1/chat/completions", json=_chat(max_completion_tokens=64, messages=[
            {"role": "user", "content": prompt}
        ])),
        400,
    )  # fmt: skip
    assert err["param"] == "max_completion_tokens" and "max_completion_tokens" in err["message"]
    err = _error(http.post("/v1/completions", json=_completion(prompt="y" * 300)), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert "256" in err["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "n": "2"}, "n"),
        ({"prompt": "hi", "temperature": "hot"}, "temperature"),
        ({"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
        ({"prompt": "hi", "stream": "yes"}, "stream"),
        ({"prompt": {"text": "hi"}}, "prompt"),
        ({"prompt": [True]}, "prompt"),
        ({"prompt": "hi", "stop": 5}, "stop"),
        ({"prompt": "hi", "logit_bias": [1, 2]}, "logit_bias"),
        ({"max_tokens": 2}, "prompt"),
    ],
)
def test_wrong_types_400(http, body, param) -> None:
    err = _error(http.post("/v1/completions", json=body), 400)
    assert err["param"] == param
    assert param in err["message"]


def test_extra_fields_400_name_the_field(http) -> None:
    err = _error(http.post("/v1/completions", json=_completion(temprature=0.5)), 400)
    assert err["param"] == "temprature" and err["code"] == "unknown_field"
    assert "temprature" in err["message"]
    body = _chat(messages=[{"role": "user", "content": "x", "toolcalls": []}])
    err = _error(http.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == "messages.0.toolcalls"


def test_malformed_and_empty_bodies_400(http) -> None:
    err = _error(http.post("/v1/completions", content=b'{"prompt": "hi",'), 400)
    assert err["code"] == "malformed_json" and "JSON" in err["message"]
    err = _error(http.post("/v1/completions", content=b'{"prompt": "a", "temperature": NaN}'), 400)
    assert err["code"] in ("malformed_json", "invalid_type")
    err = _error(http.post("/v1/completions", content=b"[1, 2]"), 400)
    assert "JSON object" in err["message"]
    err = _error(http.post("/v1/chat/completions", content=b""), 400)
    assert "empty" in err["message"]


def test_a_json_body_under_any_content_type_is_read(http) -> None:
    """curl -d sends a form Content-Type; the body is still read as JSON, strictly."""
    body = json.dumps(_completion(max_tokens=2)).encode()
    for content_type in ("application/x-www-form-urlencoded", "text/plain", None):
        headers = {} if content_type is None else {"Content-Type": content_type}
        r = http.post("/v1/completions", content=body, headers=headers)
        assert r.status_code == 200, (content_type, r.text)
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    err = _error(http.post("/v1/completions", content=b'{"prompt": 5}', headers=form), 400)
    assert err["param"] == "prompt"


def test_response_format_text_is_accepted(http) -> None:
    r = http.post(
        "/v1/chat/completions", json=_chat(max_tokens=2, response_format={"type": "text"})
    )
    assert r.status_code == 200, r.text


def test_unknown_model_and_route_404(http) -> None:
    err = _error(http.post("/v1/completions", json=_completion(model="gpt-4o")), 404)
    assert err["param"] == "model" and err["code"] == "model_not_found"
    assert "gpt-4o" in err["message"] and MODEL_NAME in err["message"]
    err = _error(http.post("/v1/audio/speech", json={}), 404)
    assert "/v1/audio/speech" in err["message"]
    err = _error(http.get("/v1/completions"), 405)
    assert err["code"] == "method_not_allowed"


def test_body_over_limit_413(http) -> None:
    big = _completion(prompt="z" * (MAX_BODY + 10))
    err = _error(http.post("/v1/completions", json=big), 413)
    assert str(MAX_BODY) in err["message"] and err["code"] == "request_too_large"

    def chunked():  # no Content-Length: the limit applies while reading
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"z" * 1000
        yield b'"}'

    err = _error(http.post("/v1/completions", content=chunked()), 413)
    assert err["code"] == "request_too_large"


def test_api_keys_401(server) -> None:
    url = f"{server.url}/v1/models"
    for headers in (
        {},
        {"Authorization": "Bearer nope"},
        {"Authorization": KEYS[0]},  # no scheme
        {"X-Api-Key": "key-one-but-longer"},
    ):
        err = _error(httpx.get(url, headers=headers), 401)
        assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
    for headers in (
        {"Authorization": f"Bearer {KEYS[1]}"},
        {"Authorization": f"bearer {KEYS[0]}"},
        {"X-Api-Key": KEYS[1]},
    ):
        assert httpx.get(url, headers=headers).status_code == 200
    # Every route but /health needs the key, unknown ones included.
    assert httpx.get(f"{server.url}/health").status_code == 200
    _error(httpx.get(f"{server.url}/metrics"), 401)
    _error(httpx.post(f"{server.url}/v1/nothing-here"), 401)
    _error(httpx.post(f"{server.url}/tokenize", json={"prompt": "a"}), 401)


def test_tokenize_detokenize(http) -> None:
    ids = http.post("/tokenize", json={"prompt": "héllo"}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "<s>héllo"
    err = _error(http.post("/detokenize", json={"tokens": [-1]}), 400)
    assert err["param"] == "tokens"
    err = _error(http.post("/tokenize", json={}), 400)
    assert "prompt" in err["message"]
    assert http.get("/version").json()["version"]


def test_queue_full_429(server) -> None:
    """max_num_seqs 1 + max_queue 1: with two requests in flight the third is refused."""

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=30) as client:
            # Long enough that neither finishes before the third arrives, even on a GPU.
            long = _completion(max_tokens=200, ignore_eos=True, stream=True)
            async with client.stream("POST", "/v1/completions", json=long) as first:
                assert first.status_code == 200
                async with client.stream("POST", "/v1/completions", json=long) as second:
                    assert second.status_code == 200
                    assert server.state.num_admitted == 2
                    third = await client.post("/v1/completions", json=_completion())
                    err = _error(third, 429)
                    assert err["code"] == "queue_full" and err["type"] == "rate_limit_error"
                    assert third.headers["retry-after"] == "1"
            # Both streams were closed early: aborted, nothing held.

    asyncio.run(scenario())
    server.wait_idle()
    assert server.state.num_admitted == 0
    r = httpx.post(f"{server.url}/v1/completions", json=_completion(), headers=AUTH)
    assert r.status_code == 200


def test_503_while_loading_then_200(tiny_model_dir) -> None:
    release = threading.Event()
    args = tiny_engine_args(tiny_model_dir("llama"))

    def slow_load() -> AsyncEngine:
        assert release.wait(30)
        return AsyncEngine.from_args(args)

    srv = LiveServer(slow_load).start(wait_ready=False)
    try:
        health = httpx.get(f"{srv.url}/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        err = _error(httpx.post(f"{srv.url}/v1/completions", json=_completion()), 503)
        assert err["code"] == "loading" and err["type"] == "service_unavailable"
        _error(httpx.get(f"{srv.url}/v1/models"), 503)
        release.set()
        srv.wait_ready(30)
        assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}
        assert httpx.post(f"{srv.url}/v1/completions", json=_completion()).status_code == 200
    finally:
        release.set()
        srv.stop()


def test_failed_load_reports_and_stops() -> None:
    def broken_load() -> AsyncEngine:
        raise ValueError("no weights here")

    srv = LiveServer(broken_load).start(wait_ready=False)
    srv.thread.join(30)  # the server stops by itself
    assert not srv.thread.is_alive()
    assert isinstance(srv.state.load_error, ValueError)
    assert srv.state.status.value == "failed"


def test_engine_failure_mid_stream_is_an_error_chunk_then_500(tiny_model_dir) -> None:
    args = tiny_engine_args(tiny_model_dir("llama"))
    srv = LiveServer(lambda: AsyncEngine.from_args(args)).start()
    try:
        llm = srv.engine.engine
        fail_steps_after(llm, 3)  # an engine bug, three steps into the request
        body = _completion(max_tokens=20, ignore_eos=True, stream=True)
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and error["code"] == "engine_error"
        assert "boom" in error["message"]
        assert all("choices" in json.loads(e) for e in events[:-2])
        # Then the server stops by itself, exit status 1, for a supervisor to restart it.
        srv.thread.join(30)
        assert not srv.thread.is_alive()
        assert "boom" in str(srv.state.engine_error) and srv.state.exit_status == 1
        assert llm.num_free_blocks == llm.num_total_blocks  # the failed request was freed
        assert srv.state.num_admitted == 0
    finally:
        if srv.thread.is_alive():
            srv.stop()


def test_a_failure_reading_stats_mid_stream_fails_the_stream_too(tiny_model_dir) -> None:
    """The engine reads its stats after each step, asking every tensor-parallel rank: a rank
    lost between a step and that read must fail the stream (it hung the client before)."""
    args = tiny_engine_args(tiny_model_dir("llama"))
    srv = LiveServer(lambda: AsyncEngine.from_args(args)).start()
    try:
        llm = srv.engine.engine
        real_stats = llm.stats
        num_reads = 0

        def failing_stats():
            nonlocal num_reads
            num_reads += 1
            if num_reads > 3:
                raise RuntimeError("rank 1 is gone")
            return real_stats()

        llm.stats = failing_stats
        body = _completion(max_tokens=20, ignore_eos=True, stream=True)
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=30) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_error" and "rank 1 is gone" in error["message"]
        srv.thread.join(30)
        assert not srv.thread.is_alive() and srv.state.exit_status == 1
        assert srv.state.num_admitted == 0
    finally:
        if srv.thread.is_alive():
            srv.stop()


def test_a_dead_engine_answers_500_and_health_503_until_the_exit(tiny_model_dir) -> None:
    """Between the failed step and the server's exit, requests get 500 engine_error and
    /health 503 engine_failed (here the exit is held back to look at that window)."""
    args = tiny_engine_args(tiny_model_dir("llama"))
    srv = LiveServer(lambda: AsyncEngine.from_args(args)).start()
    try:
        srv.state.on_failed = None  # no exit: the window stays open
        llm = srv.engine.engine

        def failing_step(unread=()):
            raise RuntimeError("boom")

        llm.step = failing_step
        _error(httpx.post(f"{srv.url}/v1/completions", json=_completion()), 500)
        err = _error(httpx.post(f"{srv.url}/v1/completions", json=_completion()), 500)
        assert err["code"] == "engine_error"
        health = httpx.get(f"{srv.url}/health")
        assert health.status_code == 503 and health.json()["status"] == "engine_failed"
        assert srv.state.exit_status == 1
    finally:
        srv.stop()


def test_max_tokens_limit_caps_a_request_that_names_no_max_tokens(http) -> None:
    """--max-tokens-limit 200 on a 256-token context: a chat request without max_tokens stops
    at 200 tokens (it used to run to the end of the context, past the server's limit)."""
    for extra in ({}, {"max_tokens": None}, {"max_completion_tokens": None}):
        r = http.post("/v1/chat/completions", json=_chat(ignore_eos=True, **extra))
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] + 200 < 256
        assert (
            usage["completion_tokens"] == 200
            and r.json()["choices"][0]["finish_reason"] == "length"
        )
    # min_tokens above the limit is a 400 naming it, as with an explicit max_tokens.
    err = _error(http.post("/v1/chat/completions", json=_chat(min_tokens=201)), 400)
    assert "min_tokens" in err["message"]
