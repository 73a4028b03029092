"""Concurrency and aborts: streams that finish, clients that leave, and what /metrics says."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from live_server import MODEL_NAME, running_server, scrape

from tokenmill.sampling_params import SamplingParams

NUM_CLIENTS = 32
NUM_TOKENS = 24
LEAVER_TOKENS = 200


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with running_server(tiny_model_dir("llama"), engine_overrides={"max_num_seqs": 32}) as srv:
        yield srv


def _wait_for_metrics(url: str, want: dict[str, float], timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        metrics = scrape(url)
        if all(metrics.get(k) == v for k, v in want.items()):
            return metrics
        assert time.monotonic() < deadline, {k: metrics.get(k) for k in want}
        time.sleep(0.05)


async def _stream(client: httpx.AsyncClient, idx: int, leave_after: int | None) -> dict:
    """One streaming chat; returns what it saw. ``leave_after``: disconnect after that many
    content chunks (those clients ask for far more tokens, so they cannot finish first)."""
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": f"client {idx} says hello"}],
        "max_tokens": NUM_TOKENS if leave_after is None else LEAVER_TOKENS,
        "temperature": 0.8,
        "seed": idx,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    seen = {"content_chunks": 0, "finish": None, "usage": None, "done": False}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                seen["done"] = True
                continue
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            if chunk["usage"] is not None:
                seen["usage"] = chunk["usage"]
            for choice in chunk["choices"]:
                if choice["delta"].get("content"):
                    seen["content_chunks"] += 1
                if choice["finish_reason"]:
                    seen["finish"] = choice["finish_reason"]
            if leave_after is not None and seen["content_chunks"] >= leave_after:
                return seen  # leaving the block closes the connection mid-stream
    return seen


def test_32_streams_a_quarter_disconnect(server) -> None:
    before = scrape(server.url)
    leaving = set(range(0, NUM_CLIENTS, 4))

    async def run() -> list[dict]:
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 4)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60) as client:
            return await asyncio.gather(
                *(_stream(client, i, 3 if i in leaving else None) for i in range(NUM_CLIENTS))
            )

    results = asyncio.run(run())
    for idx, seen in enumerate(results):
        if idx in leaving:
            assert seen["finish"] is None and not seen["done"]
            continue
        assert seen["done"] and seen["finish"] == "length"
        assert seen["usage"]["completion_tokens"] == NUM_TOKENS
    after = _wait_for_metrics(
        server.url,
        {
            "tokenmill:num_requests_running": 0,
            "tokenmill:num_requests_waiting": 0,
            "tokenmill:kv_cache_usage_perc": 0,
        },
    )
    server.wait_idle()

    def delta(key: str) -> float:
        return after.get(key, 0) - before.get(key, 0)

    num_done = NUM_CLIENTS - len(leaving)
    assert delta("tokenmill:request_success_total{finished_reason=length}") == num_done
    assert delta("tokenmill:request_success_total{finished_reason=abort}") == len(leaving)
    assert delta("tokenmill:e2e_request_latency_seconds_count") == num_done
    assert delta("tokenmill:time_to_first_token_seconds_count") == NUM_CLIENTS
    assert delta("tokenmill:generation_tokens_total") >= num_done * NUM_TOKENS + 3 * len(leaving)
    # One gap an output after a request's first: at least one a content chunk, at most one a
    # token (outputs that queued while the server was busy come joined, as one chunk).
    num_gaps = delta("tokenmill:inter_token_latency_seconds_count")
    num_chunks = sum(seen["content_chunks"] - 1 for seen in results)
    assert num_chunks <= num_gaps <= delta("tokenmill:generation_tokens_total") - NUM_CLIENTS
    assert delta("tokenmill:prefix_cache_queries_total") > 0
    assert server.state.num_admitted == 0


def test_non_streamed_client_disconnect_aborts(server) -> None:
    before = scrape(server.url)
    body = json.dumps(
        {"model": MODEL_NAME, "prompt": "go on", "max_tokens": 240, "ignore_eos": True}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", server.config.port))
    try:
        sock.sendall(head + body)
        deadline = time.monotonic() + 10
        while server.engine.stats.num_running == 0:  # generating, no response yet
            assert time.monotonic() < deadline
            time.sleep(0.002)
    finally:
        sock.close()  # the client goes away mid-request

    def count(metrics: dict, reason: str) -> float:
        return metrics.get(f"tokenmill:request_success_total{{finished_reason={reason}}}", 0)

    after = _wait_for_metrics(
        server.url,
        {
            "tokenmill:num_requests_running": 0,
            "tokenmill:kv_cache_usage_perc": 0,
            "tokenmill:request_success_total{finished_reason=abort}": count(before, "abort") + 1,
        },
    )
    assert count(after, "length") == count(before, "length")  # it did not run to the end
    server.wait_idle()


def test_cancelled_python_stream_frees_blocks(server) -> None:
    """The async API alone: cancelling the consumer aborts the request in the engine."""
    engine = server.engine

    async def consume(started: asyncio.Event) -> None:
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        async for _ in engine.generate("cancel me", params):
            started.set()

    async def run() -> None:
        started = asyncio.Event()
        task = asyncio.create_task(consume(started))
        await asyncio.wait_for(started.wait(), 10)
        assert engine.num_unfinished == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    server.wait_idle(timeout=2.0)


def test_metrics_names_and_types(server) -> None:
    text = httpx.get(f"{server.url}/metrics").text
    for name, kind in [
        ("time_to_first_token_seconds", "histogram"),
        ("inter_token_latency_seconds", "histogram"),
        ("request_time_per_output_token_seconds", "histogram"),
        ("e2e_request_latency_seconds", "histogram"),
        ("request_queue_time_seconds", "histogram"),
        ("prompt_tokens", "counter"),
        ("generation_tokens", "counter"),
        ("request_success", "counter"),
        ("num_preemptions", "counter"),
        ("prefix_cache_queries", "counter"),
        ("prefix_cache_hits", "counter"),
        ("num_requests_running", "gauge"),
        ("num_requests_waiting", "gauge"),
        ("kv_cache_usage_perc", "gauge"),
    ]:
        exposed = f"{name}_total" if kind == "counter" else name
        assert f"# TYPE tokenmill:{exposed} {kind}" in text
    assert f'model_name="{MODEL_NAME}"' in text
