"""``tokenmill bench serve``: a streaming HTTP client that benchmarks any OpenAI-compatible
server (tokenmill, vLLM, llama.cpp's llama-server, a hosted API) as vLLM's
``benchmarks/serve`` does. It loads no engine and imports no torch.

Requests are sent at Poisson (burstiness 1) or gamma arrival times (shape = burstiness, mean
1 / rate; rate inf: all at once), at most ``max_concurrency`` in flight; each streams with
``stream_options.include_usage`` and asks for exactly its output length (``max_tokens`` and
``ignore_eos``, which tokenmill and vLLM honour and others ignore). A request's clock starts
when it is sent (after waiting for a concurrency slot, as vLLM's).
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

from tokenmill.bench.datasets import Dataset, SampleRequest
from tokenmill.bench.metrics import RequestResult

if TYPE_CHECKING:
    from tokenmill.tokenizer import Tokenizer

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
_ERROR_TEXT_LEN = 300


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """Where and how to send the requests."""

    base_url: str
    model: str | None = None  # None: the first id of GET /v1/models
    endpoint: str = "completions"
    request_rate: float = math.inf  # requests / s
    burstiness: float = 1.0
    max_concurrency: int | None = None
    api_key: str | None = None
    seed: int = 0
    ignore_eos: bool = True
    timeout_s: float = 6 * 3600.0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be completions or chat; got {self.endpoint!r}")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (or inf); got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness must be > 0; got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1; got {self.max_concurrency}")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/").removesuffix("/v1") + ENDPOINTS[self.endpoint]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def arrival_offsets(num_requests: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent: the first at 0, then gaps drawn
    from a gamma distribution of shape ``burstiness`` and mean ``1 / rate`` (burstiness 1:
    a Poisson process); all 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def _payload(cfg: ServeConfig, model: str, req: SampleRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    return body


def error_text(status: int, body: bytes) -> str:
    """``HTTP 400: <the server's message>`` (OpenAI's error.message, else the body's text)."""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        err = data.get("error", data.get("detail", data.get("message")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            text = err if isinstance(err, str) else json.dumps(err)
    return f"HTTP {status}: {text[:_ERROR_TEXT_LEN]}"


def _chunk_text(data: dict[str, Any]) -> str:
    choices = data.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        delta = choice["delta"] or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


async def send_request(
    client: httpx.AsyncClient,
    cfg: ServeConfig,
    model: str,
    req: SampleRequest,
    tokenizer: Tokenizer | None,
    clock_zero: float,
) -> RequestResult:
    """Stream one request; a non-200 answer, an error event or no content is a failure."""
    result = RequestResult(success=False, prompt_len=req.prompt_len)
    start = time.perf_counter()
    result.start_time = start - clock_zero
    usage: dict[str, Any] | None = None
    pieces: list[str] = []
    last_choice: float | None = None
    try:
        async with client.stream(
            "POST", cfg.url, json=_payload(cfg, model, req), headers=cfg.headers
        ) as resp:
            if resp.status_code != 200:
                result.error = error_text(resp.status_code, await resp.aread())
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                now = time.perf_counter()
                data = json.loads(payload)
                if "error" in data:
                    err = data["error"]
                    message = err.get("message", err) if isinstance(err, dict) else err
                    result.error = f"stream error: {str(message)[:_ERROR_TEXT_LEN]}"
                    return result
                if data.get("choices"):
                    last_choice = now - start
                if text := _chunk_text(data):
                    result.chunk_times.append(now - start)
                    pieces.append(text)
                if data.get("usage"):
                    usage = data["usage"]
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {str(e)[:_ERROR_TEXT_LEN] or 'no message'}"
        return result
    result.generated_text = "".join(pieces)
    if not result.chunk_times:
        if last_choice is None:
            result.error = "no choice in the stream"
            return result
        # NOTE: text held back (an incomplete UTF-8 character, skipped special tokens) can
        # leave every chunk empty; as vLLM, the request then succeeded at its last choice.
        result.chunk_times.append(last_choice)
    result.success = True
    if usage and usage.get("completion_tokens") is not None:
        result.output_len, result.output_len_source = int(usage["completion_tokens"]), "usage"
    elif tokenizer is not None:
        result.output_len = len(tokenizer.encode(result.generated_text, add_special_tokens=False))
        result.output_len_source = "tokenizer"
    else:
        result.output_len = len(result.chunk_times)
    if usage and usage.get("prompt_tokens") is not None:
        result.prompt_len, result.prompt_len_source = int(usage["prompt_tokens"]), "usage"
    return result


def _client(cfg: ServeConfig) -> httpx.AsyncClient:
    limit = cfg.max_concurrency or 10_000
    return httpx.AsyncClient(
        timeout=httpx.Timeout(cfg.timeout_s, connect=30.0),
        limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
    )


def fetch_model(cfg: ServeConfig) -> str:
    """The first model id of GET /v1/models; ValueError when the server does not answer."""
    url = cfg.base_url.rstrip("/").removesuffix("/v1") + "/v1/models"
    try:
        resp = httpx.get(url, headers=cfg.headers, timeout=30.0)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach {url}: {e}") from None
    if resp.status_code != 200:
        raise ValueError(f"GET {url}: {error_text(resp.status_code, resp.content)}")
    try:
        return resp.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(f"GET {url} listed no model; give --model") from None


async def _run(
    cfg: ServeConfig, model: str, requests: list[SampleRequest], tokenizer: Tokenizer | None
) -> tuple[list[RequestResult], float, RequestResult]:
    from tqdm import tqdm

    offsets = arrival_offsets(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)
    slots = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    async with _client(cfg) as client:
        test = await send_request(
            client, cfg, model, SampleRequest("Hello", 1, 2), None, time.perf_counter()
        )
        if not test.success:
            raise ValueError(f"the test request to {cfg.url} failed: {test.error}")
        bar = tqdm(total=len(requests), file=sys.stderr, disable=not cfg.progress, unit="req")
        clock_zero = time.perf_counter()

        async def one(req: SampleRequest, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, clock_zero + offset - time.perf_counter()))
            if slots is None:
                result = await send_request(client, cfg, model, req, tokenizer, clock_zero)
            else:
                async with slots:
                    result = await send_request(client, cfg, model, req, tokenizer, clock_zero)
            bar.update(1)
            return result

        results = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets)))
        duration = time.perf_counter() - clock_zero
    bar.close()
    return list(results), duration, test


@dataclass(slots=True)
class ServeOutcome:
    """One benchmark point: what was asked, the per-request results and the wall time (the
    test request sent first, not counted, apart)."""

    config: ServeConfig
    model: str
    results: list[RequestResult]
    duration_s: float
    test_result: RequestResult


def run_serve_benchmark(
    cfg: ServeConfig, dataset: Dataset, tokenizer: Tokenizer | None = None
) -> ServeOutcome:
    """Run the dataset's requests against the server once."""
    model = cfg.model or fetch_model(cfg)
    results, duration, test = asyncio.run(_run(cfg, model, dataset.requests, tokenizer))
    return ServeOutcome(replace(cfg, model=model), model, results, duration, test)


def run_sweep(
    cfg: ServeConfig,
    dataset: Dataset,
    concurrencies: list[int],
    tokenizer: Tokenizer | None = None,
) -> list[ServeOutcome]:
    """One benchmark per max concurrency, the same requests each time."""
    return [
        run_serve_benchmark(replace(cfg, max_concurrency=c), dataset, tokenizer)
        for c in concurrencies
    ]


def parse_concurrencies(text: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]``."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--sweep-concurrency takes integers like 1,4,16; got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--sweep-concurrency takes integers >= 1 like 1,4,16; got {text!r}")
    return values
