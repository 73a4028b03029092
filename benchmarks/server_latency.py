"""Streaming inter-token latency seen by HTTP clients vs the engine's own decode step time.

For 1 and 16 concurrent streams of 128 tokens on gemma-3-270m: (1) the engine alone (LLMEngine,
no server) -> mean decode step time; (2) ``tokenmill serve`` on a loopback port, the same load
through streaming /v1/completions -> mean gap between SSE chunks per client. The difference is
what the server adds.

    python benchmarks/server_latency.py [--port 8123]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

import httpx

from tokenmill.bench.workload import random_prompts
from tokenmill.config import EngineArgs
from tokenmill.engine import LLMEngine
from tokenmill.sampling_params import SamplingParams

OUTPUT_LEN = 128
PROMPT_LEN = 64
KV = "1GiB"
MAX_LEN = 2048


def engine_step_times(concurrency: int) -> float:
    engine = LLMEngine(EngineArgs(max_model_len=MAX_LEN, kv_cache_memory=KV))
    vocab = engine.config.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    for p in random_prompts(concurrency, PROMPT_LEN, vocab, seed=5):
        engine.add_request(p, params)
    engine.step()  # prefill
    times = []
    while engine.has_unfinished_requests():
        start = time.monotonic()
        engine.step()
        times.append(time.monotonic() - start)
    return statistics.mean(times)


async def client_gaps(url: str, concurrency: int, vocab: int) -> list[float]:
    prompts = random_prompts(concurrency, PROMPT_LEN, vocab, seed=5)

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> list[float]:
        body = {
            "model": "gemma-3-270m",
            "prompt": prompt,
            "max_tokens": OUTPUT_LEN,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        stamps = []
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                is_data = line.startswith("data: ") and line != "data: [DONE]"
                if is_data and json.loads(line[6:])["choices"]:
                    stamps.append(time.monotonic())
        return [b - a for a, b in zip(stamps[1:], stamps[2:])]  # after the first token

    async with httpx.AsyncClient(timeout=600) as client:
        per_client = await asyncio.gather(*(one(client, p) for p in prompts))
    return [g for gaps in per_client for g in gaps]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8123)
    args = parser.parse_args()
    engine_ms = {c: engine_step_times(c) * 1000 for c in (1, 16)}
    server = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", "--log-level", "WARNING", "serve",
         "--port", str(args.port), "--kv-cache-memory", KV, "--max-model-len", str(MAX_LEN)],
    )  # fmt: skip
    url = f"http://127.0.0.1:{args.port}"
    try:
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        asyncio.run(client_gaps(url, 1, 262144))  # warm-up
        for c in (1, 16):
            gaps = asyncio.run(client_gaps(url, c, 262144))
            client_ms = statistics.mean(gaps) * 1000
            print(
                f"{c:>2} streams: engine decode step {engine_ms[c]:.1f} ms, client inter-token "
                f"mean {client_ms:.1f} ms (median {statistics.median(gaps) * 1000:.1f}, "
                f"p90 {statistics.quantiles(gaps, n=10)[-1] * 1000:.1f}); server adds "
                f"{(client_ms / engine_ms[c] - 1) * 100:+.1f}%",
                flush=True,
            )
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
