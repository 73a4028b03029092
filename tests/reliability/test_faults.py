"""Faults through a real server on loopback (the tiny random-weight Llama): clients that leave
at random points, aborted requests, a request that fails inside the engine, queue overflow and
KV exhaustion. After each, the other requests got exactly what they get alone, the failing one
an error (a 500, or an in-stream error chunk then [DONE]), and every KV block is free again.

The in-engine failure comes from ``hooked``: a hook run with each sequence id whose new tokens
the engine's output processor appends, whose exception fails that request alone, as a bug in
its output processing would. The same hook, sleeping instead, slows chosen requests
(``slowed``), so that a fast machine cannot finish them before their client's disconnect is
noticed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from live_server import MODEL_NAME, running_server, scrape  # noqa: E402

NUM_TOKENS = 24
LAST_CHUNK = -1  # a leave_after: go once the chunk with the finish reason is read
BYSTANDERS = [f"bystander {i} counts sheep" + " and goats" * (i % 3) for i in range(6)]


def _body(prompt: str, max_tokens: int = NUM_TOKENS, stream: bool = True, **extra: Any) -> dict:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body | extra


async def _stream(
    client: httpx.AsyncClient, body: dict, leave_after: int | None = None
) -> dict[str, Any]:
    """One streamed completion; ``leave_after``: close the connection after that many content
    chunks (0: right after the response headers, before any token; LAST_CHUNK: with the
    finish chunk read, before [DONE])."""
    seen: dict[str, Any] = {"text": "", "chunks": 0, "finish": None, "usage": None, "error": None}
    seen["done"] = False
    async with client.stream("POST", "/v1/completions", json=body) as response:
        seen["status"] = response.status_code
        if response.status_code != 200:
            seen["error"] = json.loads(await response.aread())["error"]
            return seen
        if leave_after == 0:
            return seen
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                seen["done"] = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                seen["error"] = chunk["error"]
                continue
            if chunk.get("usage"):
                seen["usage"] = chunk["usage"]
            for choice in chunk["choices"]:
                seen["text"] += choice["text"]
                seen["chunks"] += 1
                seen["finish"] = choice["finish_reason"] or seen["finish"]
            if leave_after == LAST_CHUNK:
                if seen["finish"] is not None:
                    return seen  # the finish came; [DONE] (and the usage) never read
            elif leave_after is not None and seen["chunks"] >= leave_after:
                return seen
    return seen


def _send_and_close(url: str, body: dict) -> None:
    """A client that sends its request and is gone before any byte of the answer."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head + payload)


def _baseline(url: str, prompts: list[str], **extra: Any) -> list[dict]:
    """Each prompt alone, one after another: what every concurrent run must reproduce."""
    with httpx.Client(base_url=url, timeout=60) as client:
        out = []
        for prompt in prompts:
            r = client.post("/v1/completions", json=_body(prompt, stream=False, **extra))
            assert r.status_code == 200, r.text
            out.append(r.json()["choices"][0])
        return out


def _check_bystanders(results: list[dict], baseline: list[dict]) -> None:
    for got, want in zip(results, baseline, strict=True):
        assert got["status"] == 200 and got["error"] is None and got["done"]
        assert got["text"] == want["text"]
        assert got["finish"] == "length" and got["usage"]["completion_tokens"] == NUM_TOKENS


@contextlib.contextmanager
def hooked(llm, hook):
    """Run ``hook(seq_id)`` as the engine's output processor appends each step's tokens of a
    sequence (inside its per-request guard: what the hook raises fails that request alone)."""
    processor = llm.output_processor
    append = processor._append

    def hooked_append(seq, update, params):
        hook(update.req_id)
        return append(seq, update, params)

    processor._append = hooked_append
    try:
        yield
    finally:
        del processor._append  # the class's method again


@contextlib.contextmanager
def slowed(llm, markers: tuple[str, ...], seconds: float = 0.005):
    """Each step of a request whose prompt holds one of ``markers`` takes ``seconds`` more (the
    fault hook, sleeping): on a fast machine it would otherwise finish before its client's
    disconnect or timeout is noticed. Greedy outputs do not change."""
    prompts: dict[str, bool] = {}

    def hook(seq_id: str) -> None:
        if seq_id not in prompts:
            req = llm.scheduler.requests.get(seq_id)
            text = llm.tokenizer.decode(req.prompt_token_ids) if req is not None else ""
            prompts[seq_id] = any(m in text for m in markers)
        if prompts[seq_id]:
            time.sleep(seconds)

    with hooked(llm, hook):
        yield


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with running_server(tiny_model_dir("llama"), engine_overrides={"max_num_seqs": 32}) as srv:
        yield srv


def test_clients_leaving_at_random_points(server) -> None:
    """Leavers before the request is read, before the first token, mid-stream, during the last
    chunk and at random points, among bystanders whose streams must not change."""
    baseline = _baseline(server.url, BYSTANDERS)
    before = scrape(server.url)
    rng = random.Random(26)
    # Leavers ask for 200 tokens, so they leave long before their end, but for the last-chunk
    # ones, which ask for NUM_TOKENS and leave with the finish chunk.
    leave_points = [0, 0, 0, 1, 5, 12, LAST_CHUNK, LAST_CHUNK]
    leave_points += [rng.randint(0, NUM_TOKENS) for _ in range(8)]

    async def scenario() -> tuple[list[dict], list[dict]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            loop = asyncio.get_running_loop()
            gone = [
                loop.run_in_executor(None, _send_and_close, server.url, _body(f"gone {i}", 200))
                for i in range(4)
            ]
            leavers = [
                _stream(
                    client,
                    _body(f"leaver {i}", NUM_TOKENS if n == LAST_CHUNK else 200),
                    leave_after=n,
                )
                for i, n in enumerate(leave_points)
            ]
            bystanders = [_stream(client, _body(p)) for p in BYSTANDERS]
            results = await asyncio.gather(*bystanders, *leavers, *gone)
            return results[: len(BYSTANDERS)], results[len(BYSTANDERS) : -len(gone)]

    with slowed(server.engine.engine, ("leaver", "gone"), 0.002):
        bystanders, leavers = asyncio.run(scenario())
        server.wait_idle()
    _check_bystanders(bystanders, baseline)
    # Every leaver really left early: it saw no [DONE] (a last-chunk leaver missed the finish).
    assert all(not r["done"] for r in leavers)
    server.wait_idle()
    # The engine aborted the leavers (the raw-socket ones included) instead of running them
    # to their end; the last-chunk leavers had finished.
    after = scrape(server.url)

    def delta(reason: str) -> float:
        key = f"tokenmill:request_success_total{{finished_reason={reason}}}"
        return after[key] - before.get(key, 0.0)

    assert delta("abort") == len(leave_points) - 2 + 4
    assert delta("length") == len(BYSTANDERS) + 2
    r = httpx.post(f"{server.url}/v1/completions", json=_body(BYSTANDERS[0], stream=False))
    assert r.json()["choices"][0]["text"] == baseline[0]["text"]


def test_a_non_streamed_client_that_gives_up_is_aborted(server) -> None:
    key = "tokenmill:request_success_total{finished_reason=abort}"
    before = scrape(server.url).get(key, 0.0)
    with slowed(server.engine.engine, ("slow",)), pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=_body("slow", 230, False), timeout=0.3)
    server.wait_idle()
    assert scrape(server.url)[key] == before + 1


def test_a_request_failing_inside_the_engine_fails_alone(server) -> None:
    """The fault hook raises for the victims' sequences after their third token: a streamed
    victim gets an error chunk then [DONE], a non-streamed one a 500; the bystanders' greedy
    text is unchanged, the engine stays healthy and frees every block."""
    baseline = _baseline(server.url, BYSTANDERS)
    llm = server.engine.engine
    tokenizer = llm.tokenizer

    def fault(seq_id: str) -> None:
        req = llm.scheduler.requests.get(seq_id)
        if (
            req is not None
            and req.num_output_tokens >= 3
            and "VICTIM" in tokenizer.decode(req.prompt_token_ids)
        ):
            raise RuntimeError("injected fault")

    with hooked(llm, fault):

        async def scenario() -> tuple[list[dict], dict, httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                victim = _stream(client, _body("VICTIM streamed", 40))
                plain = client.post("/v1/completions", json=_body("VICTIM plain", 40, False))
                n_victim = _stream(client, _body("VICTIM with n", 40, n=3))
                results = await asyncio.gather(
                    *[_stream(client, _body(p)) for p in BYSTANDERS], victim, plain, n_victim
                )
                *bystanders, streamed, plain_r, n_streamed = results
                assert n_streamed["error"] is not None and n_streamed["done"]
                return bystanders, streamed, plain_r

        bystanders, streamed, plain = asyncio.run(scenario())
    _check_bystanders(bystanders, baseline)
    assert streamed["status"] == 200 and streamed["done"]
    assert streamed["error"]["code"] == "engine_error"
    assert "injected fault" in streamed["error"]["message"]
    assert 0 < streamed["chunks"] <= 3 and streamed["finish"] is None
    assert plain.status_code == 500 and plain.json()["error"]["code"] == "engine_error"
    server.wait_idle()
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert not server.engine.is_dead
    r = httpx.post(f"{server.url}/v1/completions", json=_body("VICTIM now fine", stream=False))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == NUM_TOKENS


def test_queue_overflow_is_429_and_recovers(tiny_model_dir) -> None:
    """2 running + 2 waiting admitted; the rest refused with 429 and Retry-After, every
    admitted one completes, and once idle every refused one is served."""
    with running_server(
        tiny_model_dir("llama"), engine_overrides={"max_num_seqs": 2}, max_queue=2
    ) as srv:

        async def burst(prompts: list[str]) -> list[dict]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
                return await asyncio.gather(*[_stream(client, _body(p, 60)) for p in prompts])

        prompts = [f"crowd {i}" for i in range(12)]
        with slowed(srv.engine.engine, ("crowd",)):
            results = asyncio.run(burst(prompts))
        refused = [p for p, r in zip(prompts, results) if r["status"] == 429]
        served = [r for r in results if r["status"] == 200]
        assert refused and len(served) >= 4 and len(served) + len(refused) == len(prompts)
        assert all(r["error"]["code"] == "queue_full" for r in results if r["status"] == 429)
        assert all(r["usage"]["completion_tokens"] == 60 and r["done"] for r in served)
        srv.wait_idle()
        assert srv.state.num_admitted == 0
        retried = asyncio.run(burst(refused[:4]))
        assert all(r["status"] == 200 and r["usage"]["completion_tokens"] == 60 for r in retried)
        srv.wait_idle()


def test_kv_exhaustion_preemption_storm_keeps_greedy_outputs(tiny_model_dir) -> None:
    """12 requests of ~100 tokens on a pool of 19 blocks (304 tokens; each needs 6-7 blocks):
    requests are preempted over and over, and the greedy tokens and log-probs equal those of
    a pool that never runs out. Tolerance on log-probs: 1e-4 (a resumed request recomputes its
    context in one prefill instead of step by step: float32 sums in another order)."""
    prompts = [f"storm {i} " + "wind " * (i % 5) for i in range(12)]
    extra = {"logprobs": 3, "max_tokens": 80}

    async def run_all(url: str) -> list[dict]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            rs = await asyncio.gather(
                *[
                    client.post("/v1/completions", json=_body(p, stream=False, **extra))
                    for p in prompts
                ]
            )
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        return [r.json()["choices"][0] for r in rs]

    results = {}
    for name, memory in (("big", "8MiB"), ("tiny", "152KiB")):
        overrides = {"kv_cache_memory": memory, "max_num_seqs": 12}
        with running_server(tiny_model_dir("llama"), engine_overrides=overrides) as srv:
            llm = srv.engine.engine
            if name == "tiny":
                assert llm.num_total_blocks <= 19
            results[name] = asyncio.run(run_all(srv.url))
            srv.wait_idle()
            results[name + "_preemptions"] = srv.engine.stats.num_preemptions
    assert results["big_preemptions"] == 0
    assert results["tiny_preemptions"] >= 12
    for big, tiny in zip(results["big"], results["tiny"], strict=True):
        assert tiny["text"] == big["text"] and tiny["finish_reason"] == "length"
        assert tiny["logprobs"]["tokens"] == big["logprobs"]["tokens"]
        for a, b in zip(tiny["logprobs"]["token_logprobs"], big["logprobs"]["token_logprobs"]):
            assert abs(a - b) <= 1e-4
        for a, b in zip(tiny["logprobs"]["top_logprobs"], big["logprobs"]["top_logprobs"]):
            assert a.keys() == b.keys()
            assert all(abs(a[k] - b[k]) <= 1e-4 for k in a)


ADMIN_KEY = "sk-admin-faults"
USER_KEY = "sk-user-faults"


def test_admin_aborts_a_running_request_by_its_id(tiny_model_dir) -> None:
    """POST /abort_request with the admin key stops a streaming request by the id its chunks
    carry: its client gets an "aborted" error chunk then [DONE], a bystander is unaffected, a
    user key is refused (403), an unknown or finished id is 404, and no KV block is held."""
    with running_server(
        tiny_model_dir("llama"), api_keys=(USER_KEY,), admin_api_key=ADMIN_KEY
    ) as srv:
        user = {"Authorization": f"Bearer {USER_KEY}"}
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        want = httpx.post(
            f"{srv.url}/v1/completions", json=_body(BYSTANDERS[0], stream=False), headers=user
        ).json()["choices"][0]["text"]

        async def victim(client: httpx.AsyncClient) -> dict[str, Any]:
            seen: dict[str, Any] = {"chunks": 0, "error": None, "done": False}
            async with client.stream("POST", "/v1/completions", json=_body("VICTIM", 200)) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        seen["done"] = True
                        break
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        seen["error"] = chunk["error"]
                        continue
                    seen["chunks"] += 1
                    if seen["chunks"] == 2:  # mid-stream: the user key may not, the admin may
                        body = {"request_id": chunk["id"]}
                        refused = await client.post("/abort_request", json=body)
                        seen["user_status"] = refused.status_code
                        done = await client.post("/abort_request", json=body, headers=admin)
                        seen["abort"] = (chunk["id"], done.status_code, done.json())
            return seen

        async def run() -> tuple[dict, dict]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=60, headers=user) as client:
                return await asyncio.gather(victim(client), _stream(client, _body(BYSTANDERS[0])))

        with slowed(srv.engine.engine, ("VICTIM",)):
            seen, bystander = asyncio.run(run())
        assert "abort" in seen, seen
        request_id, status, answer = seen["abort"]
        assert seen["user_status"] == 403
        assert status == 200 and answer == {"aborted": [request_id]}
        assert seen["error"]["code"] == "aborted" and "administrator" in seen["error"]["message"]
        assert seen["done"] and seen["chunks"] < 200
        assert bystander["text"] == want and bystander["done"]
        srv.wait_idle()
        again = httpx.post(
            f"{srv.url}/abort_request", json={"request_id": request_id}, headers=admin
        )
        assert again.status_code == 404 and again.json()["error"]["param"] == "request_id"
        bad = httpx.post(f"{srv.url}/abort_request", json={"id": request_id}, headers=admin)
        assert bad.status_code == 400
