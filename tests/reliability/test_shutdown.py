"""Shutdown under load, through ``tokenmill serve`` as a subprocess on a free port (the tiny
random-weight Llama): SIGTERM drains every in-flight stream within --shutdown-timeout and
exits 0; SIGKILL leaves clients with connection errors at once, not hangs; a restart on the
same port serves again."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from live_server import MODEL_NAME, free_port  # noqa: E402

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

NUM_CLIENTS = 12
NUM_TOKENS = 200  # long enough that no stream ends before the signal, even on a GPU


def start(model_dir: Path, port: int, log: Path) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "tokenmill.cli", "serve", str(model_dir), "--port", str(port),
        "--max-model-len", "256", "--kv-cache-memory", "8MiB", "--served-model-name", MODEL_NAME,
        "--shutdown-timeout", "60", "--log-stats-interval", "0",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log.open("a"), stderr=subprocess.STDOUT, env=os.environ)
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not become ready"
        time.sleep(0.1)


def _body(i: int) -> dict:
    return {
        "model": MODEL_NAME,
        "prompt": f"client {i} keeps talking",
        "max_tokens": NUM_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _stream(url: str, i: int, started: asyncio.Event, begun: set[int]) -> dict:
    seen: dict = {"events": [], "error": None}
    try:
        async with (
            httpx.AsyncClient(base_url=url, timeout=30) as client,
            client.stream("POST", "/v1/completions", json=_body(i)) as response,
        ):
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    seen["events"].append(line[6:])
                    begun.add(i)
                    if len(begun) == NUM_CLIENTS:
                        started.set()
    except httpx.TransportError as e:
        seen["error"] = e
    return seen


async def _under_load(url: str, act) -> tuple[list[dict], float]:
    """NUM_CLIENTS streams; ``act()`` once each has its first event; (results, seconds after
    act)."""
    started = asyncio.Event()
    begun: set[int] = set()
    tasks = [asyncio.create_task(_stream(url, i, started, begun)) for i in range(NUM_CLIENTS)]
    await asyncio.wait_for(started.wait(), 60)
    acted = time.monotonic()
    act()
    results = await asyncio.gather(*tasks)
    return results, time.monotonic() - acted


def test_sigterm_under_load_drains_and_exits_0(tiny_model_dir, tmp_path) -> None:
    port, log = free_port(), tmp_path / "server.log"
    proc = start(tiny_model_dir("llama"), port, log)
    try:
        results, _ = asyncio.run(
            _under_load(f"http://127.0.0.1:{port}", lambda: proc.send_signal(signal.SIGTERM))
        )
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for seen in results:
        assert seen["error"] is None and seen["events"][-1] == "[DONE]"
        chunks = [json.loads(e) for e in seen["events"][:-1]]
        assert not any("error" in c for c in chunks)
        assert chunks[-1]["usage"]["completion_tokens"] == NUM_TOKENS
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_sigkill_gives_connection_errors_then_a_restart_serves(tiny_model_dir, tmp_path) -> None:
    port, log = free_port(), tmp_path / "server.log"
    url = f"http://127.0.0.1:{port}"
    proc = start(tiny_model_dir("llama"), port, log)
    try:
        results, elapsed = asyncio.run(_under_load(url, proc.kill))
        proc.wait(timeout=10)
        assert proc.returncode == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Every client learns at once (well inside its 30 s read timeout) that the server is gone,
    # unless its stream had already ended.
    assert elapsed < 10
    cut = [r for r in results if r["error"] is not None]
    assert cut and all(isinstance(r["error"], httpx.TransportError) for r in cut)
    assert all(r["events"][-1] == "[DONE]" for r in results if r["error"] is None)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2)
    proc = start(tiny_model_dir("llama"), port, log)
    try:
        body = _body(0) | {"stream": False}
        body.pop("stream_options")
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == NUM_TOKENS
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
