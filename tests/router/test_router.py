"""The router over two real tokenmill servers: prefix affinity seen in the replicas' own
prefix-cache counters, streamed text equal to a replica's, keys, error bodies, /metrics."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from router_helpers import (
    AUTH,
    KEY,
    MODEL_NAME,
    AppThread,
    RouterThread,
    free_port,
    scrape,
    start_replicas,
    wait_healthy,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tokenmill.router.policy import Reason, ReplicaView, choose, rank, request_key

HITS = "tokenmill:prefix_cache_hits_total"
RUNNING = "tokenmill:num_requests_running"


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    replicas = start_replicas(tiny_model_dir("llama"), tmp_path_factory.mktemp("replicas"), 2)
    router = RouterThread([r.url for r in replicas]).start()
    try:
        yield router, replicas
    finally:
        router.stop()
        for r in replicas:
            r.stop()


def _prefix_for(urls: list[str], target: int, tag: str) -> str:
    """A 200-character prefix whose key the policy sends to replica ``target``."""
    views = [ReplicaView(u) for u in urls]
    for i in range(1000):
        prefix = (f"{tag} shared system prompt number {i}, " * 10)[:200]
        if choose(request_key({"prompt": prefix + "x"}), views).replica_idx == target:
            return prefix
    raise AssertionError("no prefix found")


def _hits(url: str) -> float:
    return scrape(url)[HITS]


def test_requests_sharing_a_prefix_land_on_one_replica(cluster) -> None:
    router, replicas = cluster
    urls = [r.url for r in replicas]
    before_decisions = scrape(router.url)
    for target in (0, 1):
        prefix = _prefix_for(urls, target, f"group{target}")
        before = [_hits(u) for u in urls]
        cached = 0
        for question in ("What is two plus two?", "Name a colour, please.", "Why?"):
            body = {"model": MODEL_NAME, "prompt": prefix + question, "max_tokens": 2}
            r = httpx.post(f"{router.url}/v1/completions", json=body | {"temperature": 0},
                           headers=AUTH, timeout=60)  # fmt: skip
            assert r.status_code == 200, r.text
            assert r.headers["x-tokenmill-replica"] == urls[target]
            cached += r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        after = [_hits(u) for u in urls]
        # The 2nd and 3rd request reuse the 200-character prefix's whole 16-token blocks.
        assert cached >= 2 * 192
        assert after[target] - before[target] == cached
        assert after[1 - target] == before[1 - target]
    decisions = scrape(router.url)
    prefix_hits = "tokenmill_router:routing_decisions_total{reason=prefix_hit}"
    assert decisions[prefix_hits] - before_decisions[prefix_hits] == 6
    for url in urls:
        sent = f"tokenmill_router:replica_requests_total{{replica={url}}}"
        assert decisions[sent] - before_decisions[sent] == 3
        assert decisions[f"tokenmill_router:replica_healthy{{replica={url}}}"] == 1
        assert decisions[f"tokenmill_router:replica_in_flight{{replica={url}}}"] == 0


def test_streamed_text_through_the_router_equals_the_replicas(cluster) -> None:
    router, replicas = cluster
    via = openai.OpenAI(base_url=f"{router.url}/v1", api_key=KEY, max_retries=0)
    prompt = "Once upon a time, in a land far away,"
    for replica in replicas:
        direct = openai.OpenAI(base_url=f"{replica.url}/v1", api_key=KEY, max_retries=0)
        args = dict(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0)
        expected = direct.completions.create(**args).choices[0].text
        stream = via.completions.create(**args, stream=True)
        chunks = [c.choices[0].text for c in stream if c.choices]
        assert len(chunks) > 1 and "".join(chunks) == expected
        assert via.completions.create(**args).choices[0].text == expected
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    args = dict(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0)
    direct = openai.OpenAI(base_url=f"{replicas[0].url}/v1", api_key=KEY, max_retries=0)
    expected = direct.chat.completions.create(**args).choices[0].message.content
    stream = via.chat.completions.create(**args, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == expected
    assert [m.id for m in via.models.list()] == [MODEL_NAME]


def test_ollama_routes_pass_through(cluster) -> None:
    router, replicas = cluster
    body = {"model": MODEL_NAME, "prompt": "Hello", "options": {"num_predict": 5, "temperature": 0}}
    direct = httpx.post(f"{replicas[0].url}/api/generate", json=body | {"stream": False},
                        headers=AUTH, timeout=60).json()  # fmt: skip
    lines = []
    with httpx.stream("POST", f"{router.url}/api/generate", json=body, headers=AUTH,
                      timeout=60) as r:  # fmt: skip
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [line for line in r.iter_lines() if line]
    parts = [json.loads(line) for line in lines]
    assert parts[-1]["done"] is True
    assert "".join(p["response"] for p in parts) == direct["response"]
    tags = httpx.get(f"{router.url}/api/tags", headers=AUTH).json()
    assert [m["name"] for m in tags["models"]] == [MODEL_NAME]


def test_keys_and_error_bodies(cluster) -> None:
    router, _ = cluster
    r = httpx.post(f"{router.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "a"})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{router.url}/metrics").status_code == 401
    health = httpx.get(f"{router.url}/health")  # open, as the server's
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert [r["healthy"] for r in health.json()["replicas"]] == [True, True]
    r = httpx.get(f"{router.url}/v1/nothing", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(f"{router.url}/v1/completions", headers=AUTH)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    # A replica's own 4xx passes through unchanged (the key went on, so it got that far).
    r = httpx.post(f"{router.url}/v1/completions", json={"model": MODEL_NAME}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_metrics_public_opens_only_metrics(cluster) -> None:
    _, replicas = cluster
    router = RouterThread([r.url for r in replicas], metrics_public=True).start()
    try:
        r = httpx.get(f"{router.url}/metrics")
        assert r.status_code == 200 and "tokenmill_router:replica_healthy" in r.text
        body = {"model": MODEL_NAME, "prompt": "a"}
        assert httpx.post(f"{router.url}/v1/completions", json=body).status_code == 401
        assert httpx.post(f"{router.url}/reset_prefix_cache").status_code == 401
    finally:
        router.stop()


def _prompt_ranking_first(urls: list[str], first: int) -> str:
    for i in range(1000):
        prompt = f"Prompt {i} for the retry test"
        if rank(request_key({"prompt": prompt}), urls)[0] == first:
            return prompt
    raise AssertionError("no prompt found")


def test_connection_refused_retries_on_another_replica(cluster) -> None:
    _, replicas = cluster
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    router = RouterThread([dead, replicas[0].url], health_interval=3600).start()
    try:
        assert router.replicas[0].healthy is False  # the first check found it down
        router.replicas[0].healthy = True  # as if it died after the last check
        prompt = _prompt_ranking_first([dead, replicas[0].url], 0)
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 3, "temperature": 0}
        r = httpx.post(f"{router.url}/v1/completions", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200 and r.headers["x-tokenmill-replica"] == replicas[0].url
        assert r.json()["usage"]["completion_tokens"] == 3
        metrics = scrape(router.url)
        assert metrics["tokenmill_router:routing_decisions_total{reason=prefix_hit}"] == 1
        assert metrics["tokenmill_router:routing_decisions_total{reason=retry}"] == 1
        assert metrics[f"tokenmill_router:replica_failures_total{{replica={dead}}}"] == 1
        assert metrics[f"tokenmill_router:replica_healthy{{replica={dead}}}"] == 0
        assert "ConnectError" in router.replicas[0].last_error
    finally:
        router.stop()


def _always_503() -> Starlette:
    async def health(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def busy(_: Request) -> JSONResponse:
        body = {"error": {"message": "loading", "type": "service_unavailable", "param": None,
                          "code": "model_loading"}}  # fmt: skip
        return JSONResponse(body, status_code=503)

    return Starlette(routes=[Route("/health", health), Route("/v1/completions", busy,
                                                             methods=["POST"])])  # fmt: skip


def test_a_5xx_retries_elsewhere_and_is_answered_when_no_replica_is_left(cluster) -> None:
    _, replicas = cluster
    upstream = AppThread(_always_503()).start()
    router = RouterThread([upstream.url, replicas[0].url], health_interval=3600).start()
    try:
        prompt = _prompt_ranking_first([upstream.url, replicas[0].url], 0)
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2}
        r = httpx.post(f"{router.url}/v1/completions", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200 and r.headers["x-tokenmill-replica"] == replicas[0].url
        assert router.replicas[0].healthy is False and router.replicas.decisions[Reason.RETRY] == 1
        router.replicas[1].healthy = False  # now only the 503 one, marked up again
        router.replicas[0].healthy = True
        r = httpx.post(f"{router.url}/v1/completions", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        router.replicas[0].healthy = False  # none left at all
        r = httpx.post(f"{router.url}/v1/completions", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_replica"
        assert httpx.get(f"{router.url}/health").status_code == 503
    finally:
        router.stop()
        upstream.stop()


def test_a_client_that_leaves_aborts_the_replicas_request(cluster) -> None:
    router, replicas = cluster
    before = [scrape(r.url)["tokenmill:generation_tokens_total"] for r in replicas]
    body = {"model": MODEL_NAME, "prompt": "Talk for a long time.", "max_tokens": 400,
            "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, headers=AUTH,
                      timeout=60) as r:  # fmt: skip
        serving = [r.url for r in replicas].index(r.headers["x-tokenmill-replica"])
        next(line for line in r.iter_lines() if line.startswith("data: "))
    deadline = time.monotonic() + 10
    while router.replicas[serving].in_flight or scrape(replicas[serving].url)[RUNNING]:
        assert time.monotonic() < deadline, "the replica still runs the abandoned request"
        time.sleep(0.02)
    generated = scrape(replicas[serving].url)["tokenmill:generation_tokens_total"]
    assert generated - before[serving] < 400


def test_the_router_command(cluster, tmp_path) -> None:
    _, replicas = cluster
    port = free_port()
    cmd = [sys.executable, "-m", "tokenmill.cli", "router", "--port", str(port),
           "--api-key", KEY, *(a for r in replicas for a in ("--replica", r.url))]  # fmt: skip
    log_path = tmp_path / "router.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 30, proc, log_path)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        out = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=4)
        assert out.usage.completion_tokens == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert f"router at http://127.0.0.1:{port}/v1 over 2 replicas" in text
    assert "HTTP Request:" not in text  # httpx's per-request lines stay out of the log


def test_a_prefix_cache_reset_reaches_every_replica(cluster) -> None:
    router, replicas = cluster
    urls = [r.url for r in replicas]

    def cached(prompt: str) -> int:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1}
        r = httpx.post(f"{router.url}/v1/completions", json=body, headers=AUTH, timeout=60)
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    prompts = [_prefix_for(urls, target, f"reset{target}") for target in (0, 1)]
    for prompt in prompts:
        cached(prompt)
        assert cached(prompt) > 0
    r = httpx.post(f"{router.url}/reset_prefix_cache", headers=AUTH)
    assert r.status_code == 200 and r.json() == {"reset": True}
    assert [cached(prompt) for prompt in prompts] == [0, 0]
    assert httpx.post(f"{router.url}/reset_prefix_cache").status_code == 401


def _aborts(request_id: str) -> Starlette:
    """A replica that holds request ``request_id`` and aborts it when asked."""

    async def health(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def abort(request: Request) -> JSONResponse:
        if (await request.json())["request_id"] != request_id:
            body = {"error": {"message": "no such request", "type": "invalid_request_error",
                              "param": "request_id", "code": "not_found"}}  # fmt: skip
            return JSONResponse(body, status_code=404)
        return JSONResponse({"aborted": [request_id]})

    return Starlette(routes=[Route("/health", health),
                             Route("/abort_request", abort, methods=["POST"])])  # fmt: skip


def test_an_abort_is_answered_by_the_replica_that_holds_the_request(cluster) -> None:
    """/abort_request goes to every replica: the one holding the id answers 200 whichever
    order they are in; an id nobody holds is a 404 (the real replicas' own answer)."""
    _, replicas = cluster
    holder = AppThread(_aborts("cmpl-held")).start()
    for order in ([holder.url, replicas[0].url], [replicas[0].url, holder.url]):
        router = RouterThread(order, health_interval=3600).start()
        try:
            for request_id, status in (("cmpl-held", 200), ("cmpl-nobody", 404)):
                r = httpx.post(f"{router.url}/abort_request", json={"request_id": request_id},
                               headers=AUTH, timeout=30)  # fmt: skip
                assert r.status_code == status, r.text
                if status == 200:
                    assert r.json() == {"aborted": ["cmpl-held"]}
                else:
                    assert r.json()["error"]["param"] == "request_id"
        finally:
            router.stop()
    holder.stop()
