"""The host's work per decode step inside ``tokenmill serve`` with many streaming clients: what
host_step.py times for the engine alone, plus the API server beside it. The server's event
loop turns each token of each stream into an SSE chunk and writes it, and holds the GIL that
the engine thread needs meanwhile, so on a GPU it is part of what must hide behind a step.

The server runs in a child process on host_step.py's toy gemma-3 (six KV groups, CUDA-graph
runner path on the CPU) with the forward left out once the first decode steps ran (as
``host_step.py --forward none``). The clients (httpx, this process) stream --requests
completions of --tokens tokens through /v1/completions. Reported: the core's median step
interval (start to start: EngineCore.step, timed in whichever process runs it) while every
request streams, and its median step time, beside the engine alone at the same number of
requests (host_step's delta kind, forward left out). ``--core-process`` runs the server with
the engine core in a process of its own (EngineArgs.core_process).

    .venv/bin/python benchmarks/server_host.py [--requests 256] [--tokens 300] [--core-process]
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
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
# The server's child process tells the process that runs the core (itself, or the core's own)
# the model and where the core's step times go.
MODEL_ENV, STATS_ENV = "SERVER_HOST_MODEL", "SERVER_HOST_STATS"


def in_core() -> None:
    """Patches for the process that runs the engine core: the toy's CUDA-graph runner path on
    the CPU, its forward left out after the first replays, and EngineCore.step timed (start,
    seconds, running requests), written out as the process exits."""
    from tokenizers import Tokenizer

    from tokenmill.engine.engine_core import EngineCore
    from tokenmill.worker import worker
    from tokenmill.worker.cuda_graph import CudaDecodeGraphs

    model_dir, stats_path = os.environ[MODEL_ENV], os.environ[STATS_ENV]
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
    step = EngineCore.step

    def timed_step(core: EngineCore) -> list:
        start = time.perf_counter()
        updates = step(core)
        steps.append((start, time.perf_counter() - start, core.scheduler.num_running))
        return updates

    EngineCore.step = timed_step  # type: ignore[method-assign]
    atexit.register(lambda: Path(stats_path).write_text(json.dumps(steps)))


def serve(
    model_dir: str, port: int, max_num_seqs: int, stats_path: str, core_process: bool
) -> None:
    """The child: ``tokenmill serve``'s app under uvicorn, the core's steps timed."""
    from tokenmill.config import EngineArgs
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.engine.core_process import CoreProcess
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.server.api import create_app
    from tokenmill.server.config import ServerConfig
    from tokenmill.server.launcher import TokenmillServer

    os.environ[MODEL_ENV], os.environ[STATS_ENV] = model_dir, stats_path
    args = EngineArgs(
        model=model_dir, dtype="float32", kernel_backend="torch", max_model_len=1024,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=8192, core_process=core_process,
        # One torch thread, as for a GPU's host: its torch ops there are small, and more
        # threads spin against the server's (the core's step took 5-7 ms with torch's default
        # 2 here, 1.4 ms with 1, in its own process).
        num_threads=1,
    )  # fmt: skip
    if not core_process:
        in_core()  # the core runs here

    def load() -> AsyncEngine:
        core = CoreProcess(args, setup="server_host:in_core") if core_process else None
        return AsyncEngine(LLMEngine(args, core))

    config = ServerConfig(
        host="127.0.0.1", port=port, served_model_name="toy", log_stats_interval=0,
        max_queue=None,
    )  # fmt: skip
    app = create_app(config, load)
    TokenmillServer(app, config, log_level="warning").run()


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
    p.add_argument("--core-process", action="store_true", help="the engine core apart")
    p.add_argument("--serve", nargs=2, metavar=("MODEL_DIR", "STATS"), help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.serve:
        serve(ns.serve[0], ns.port, ns.requests, ns.serve[1], ns.core_process)
        return
    if ns.tokens < 50:
        p.error("--tokens must be at least 50 (the steps while all stream are measured)")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_synthetic_gemma(Path(tmp) / "toy", **TOY_GEMMA)
        stats = Path(tmp) / "steps.json"
        url = f"http://127.0.0.1:{ns.port}"
        cmd = [sys.executable, __file__, "--requests", str(ns.requests), "--port", str(ns.port),
               "--serve", model_dir, str(stats)]  # fmt: skip
        if ns.core_process:
            cmd.append("--core-process")
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
    where = "in its own process" if ns.core_process else "in the server's process"
    print(f"  the core {where}, step start to start: {statistics.median(intervals) * 1e3:.2f}")
    print(f"  the core's step itself: {statistics.median(d for _, d in full) * 1e3:.2f}")
    print(f"  the engine alone (host_step.py --forward none, delta): {alone:.2f}")


if __name__ == "__main__":
    main()
