"""The host's work per decode step inside ``tokenmill serve`` with many streaming clients: what
host_step.py times for the engine alone, plus the API server beside it. The server's event
loop turns each token of each stream into an SSE chunk and writes it, and holds the GIL that
the engine thread needs meanwhile, so on a GPU it is part of what must hide behind a step.

The server runs in a child process on host_step.py's toy gemma-3 (six KV groups, CUDA-graph
runner path on the CPU) with the forward left out once the first decode steps ran (as
``host_step.py --forward none``). The clients (httpx, this process) stream --requests
completions of --tokens tokens through /v1/completions. Reported: the engine's median step
interval (start to start) while every request streams, and its median step time, beside the
engine alone at the same number of requests (host_step's delta kind, forward left out).

    .venv/bin/python benchmarks/server_host.py [--requests 256] [--tokens 300]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Container
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from gpu_check import build_synthetic_gemma  # noqa: E402
from host_step import engine_host_ms  # noqa: E402

# host_step.py's toy gemma-3: gemma-3-270m's KV layout, a model that costs little.
TOY_GEMMA = dict(
    vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=24,
    query_pre_attn_scalar=16, max_position_embeddings=4096,
)  # fmt: skip
PROMPT_LEN = 100
NUM_FORWARD_REPLAYS = 3  # decode graph replays run before the forward is left out


def serve(model_dir: str, port: int, max_num_seqs: int, stats_path: str) -> None:
    """The child: ``tokenmill serve``'s app under uvicorn, the engine's steps timed."""
    from tokenizers import Tokenizer

    from tokenmill.config import EngineArgs
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.server.api import create_app
    from tokenmill.server.config import ServerConfig
    from tokenmill.server.launcher import TokenmillServer
    from tokenmill.worker import worker
    from tokenmill.worker.cuda_graph import CudaDecodeGraphs

    worker.cuda_graphs_supported = lambda device: True
    token_a = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")).token_to_id("a")
    replay = CudaDecodeGraphs.replay
    num_replays = [0]

    def replay_first_few(graphs: CudaDecodeGraphs, b: int) -> None:
        # The first replays make the logits buffer the sampler then reads. From then on every
        # row picks "a", so each token of each stream is a chunk, as with a real model's text.
        num_replays[0] += 1
        if num_replays[0] <= NUM_FORWARD_REPLAYS:
            replay(graphs, b)
        elif num_replays[0] == NUM_FORWARD_REPLAYS + 1:
            assert graphs.logits is not None
            graphs.logits.zero_()
            graphs.logits[:, token_a] = 1.0

    CudaDecodeGraphs.replay = replay_first_few  # type: ignore[method-assign]
    steps: list[tuple[float, float, int]] = []  # (start, seconds, running requests)
    step = LLMEngine.step

    def timed_step(engine: LLMEngine, unread: Container[str] = ()) -> list:
        start = time.perf_counter()
        outputs = step(engine, unread)
        steps.append((start, time.perf_counter() - start, engine.stats().num_running))
        return outputs

    LLMEngine.step = timed_step  # type: ignore[method-assign]
    args = EngineArgs(
        model=model_dir, dtype="float32", kernel_backend="torch", max_model_len=1024,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=8192,
    )  # fmt: skip
    config = ServerConfig(
        host="127.0.0.1", port=port, served_model_name="toy", log_stats_interval=0,
        max_queue=None,
    )  # fmt: skip
    app = create_app(config, lambda: AsyncEngine.from_args(args))
    TokenmillServer(app, config, log_level="warning").run()
    Path(stats_path).write_text(json.dumps(steps))


async def stream_all(url: str, num_requests: int, num_tokens: int) -> tuple[float, int, int]:
    """Stream ``num_requests`` completions at once; (seconds, chunks read, tokens streamed)."""
    body = dict(model="toy", max_tokens=num_tokens, temperature=0.0, ignore_eos=True,
                stream=True, stream_options={"include_usage": True})  # fmt: skip
    limits = httpx.Limits(max_connections=num_requests + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def one(i: int) -> tuple[int, int]:
            prompt = [1] + [(7 * i + j) % 250 + 3 for j in range(PROMPT_LEN)]
            chunks = tokens = 0
            async with client.stream(
                "POST", "/v1/completions", json=body | {"prompt": prompt}
            ) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        chunks += bool(chunk["choices"])
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
            return chunks, tokens

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(num_requests)))
        seconds = time.perf_counter() - start
        return seconds, sum(c for c, _ in counts), sum(t for _, t in counts)


def wait_ready(url: str, child: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise SystemExit(f"the server exited ({child.returncode}) while starting")
        with contextlib.suppress(httpx.HTTPError):  # not listening yet
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    raise SystemExit("the server did not become ready")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--tokens", type=int, default=300, help="output tokens a request")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--serve", nargs=2, metavar=("MODEL_DIR", "STATS"), help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.serve:
        serve(ns.serve[0], ns.port, ns.requests, ns.serve[1])
        return
    if ns.tokens < 50:
        p.error("--tokens must be at least 50 (the steps while all stream are measured)")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_synthetic_gemma(Path(tmp) / "toy", **TOY_GEMMA)
        stats = Path(tmp) / "steps.json"
        url = f"http://127.0.0.1:{ns.port}"
        cmd = [sys.executable, __file__, "--requests", str(ns.requests), "--port", str(ns.port),
               "--serve", model_dir, str(stats)]  # fmt: skip
        child = subprocess.Popen(cmd, env=os.environ | {"PYTHONUNBUFFERED": "1"})
        try:
            wait_ready(url, child)
            asyncio.run(stream_all(url, 4, 60))  # warm-up: graphs captured, code paths run
            seconds, chunks, tokens = asyncio.run(stream_all(url, ns.requests, ns.tokens))
        finally:
            child.send_signal(signal.SIGTERM)
            child.wait(timeout=120)
        steps = json.loads(stats.read_text())
    full = [(start, dt) for start, dt, running in steps if running == ns.requests]
    intervals = [b[0] - a[0] for a, b in zip(full, full[1:], strict=False)]
    alone = engine_host_ms(ns.requests, 300, "delta", "none").host
    # A stream whose outputs queued up while the server's loop was busy gets them as one
    # chunk (AsyncEngine.generate): fewer chunks than tokens says the loop fell behind.
    print(f"{ns.requests} streaming requests of {ns.tokens} tokens ({tokens} tokens in "
          f"{chunks} chunks, {seconds:.1f} s), median ms a step while all {ns.requests} "
          "stream:")  # fmt: skip
    print(f"  in the server, step start to start: {statistics.median(intervals) * 1e3:.2f}")
    print(
        f"  in the server, the step itself:     {statistics.median(d for _, d in full) * 1e3:.2f}"
    )
    print(f"  the engine alone (host_step.py --forward none, delta): {alone:.2f}")


if __name__ == "__main__":
    main()
