"""Shutdown: in-flight requests drain within --shutdown-timeout, the rest are aborted, exit 0."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from live_server import MODEL_NAME, LiveServer, free_port, tiny_engine_args

from tokenmill.engine.async_engine import AsyncEngine


def _stream_body(max_tokens: int) -> dict:
    return {
        "model": MODEL_NAME,
        "prompt": "keep talking",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _wait_ready(proc: subprocess.Popen, url: str, log_path, timeout: float) -> None:
    """Until the server's /health is 200; fails with its log if it exits or takes too long
    (connection errors mean it is not listening yet)."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log_path.read_text()
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        assert time.monotonic() < deadline, "server did not become ready"
        time.sleep(0.1)


def test_shutdown_drains_in_flight_requests(tiny_model_dir) -> None:
    args = tiny_engine_args(tiny_model_dir("llama"))
    srv = LiveServer(lambda: AsyncEngine.from_args(args), shutdown_timeout=60).start()
    engine = srv.engine
    events: list[str] = []
    try:
        with (
            httpx.Client(base_url=srv.url, timeout=60) as client,
            client.stream("POST", "/v1/completions", json=_stream_body(40)) as response,
        ):
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[6:])
                    break
            srv.server.should_exit = True  # what SIGTERM does
            deadline = time.monotonic() + 10
            while srv.state.status.value != "stopping":
                assert time.monotonic() < deadline
                time.sleep(0.01)
            # No new connections while draining.
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"{srv.url}/health", timeout=2)
            events += [line[6:] for line in lines if line.startswith("data: ")]
    finally:
        srv.stop()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 40
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert engine.num_unfinished == 0
    assert engine.engine.num_free_blocks == engine.engine.num_total_blocks


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM")
def test_sigterm_aborts_what_is_left_and_exits_0(tiny_model_dir, tmp_path) -> None:
    port = free_port()
    cmd = [
        sys.executable, "-m", "tokenmill.cli", "serve", str(tiny_model_dir("llama")),
        "--port", str(port), "--max-model-len", "256", "--kv-cache-memory", "8MiB",
        "--served-model-name", MODEL_NAME, "--shutdown-timeout", "0", "--log-stats-interval", "0",
    ]  # fmt: skip
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url, tmp_path / "server.log", 60)
        events: list[str] = []
        with httpx.stream("POST", f"{url}/v1/completions", json=_stream_body(240), timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 2:
                    proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "aborted" and "shutting down" in error["message"]
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
    assert 2 <= len(texts) < 240
    output = (tmp_path / "server.log").read_text()
    assert "ready: weights" in output and f"http://127.0.0.1:{port}/v1" in output


def test_a_lost_tensor_parallel_rank_fails_the_stream_and_exits_1(tiny_model_dir, tmp_path) -> None:
    """A rank killed mid-stream: the client gets an engine_error chunk then [DONE], and the
    server exits with status 1 within seconds (for a supervisor to restart it)."""
    import psutil

    port = free_port()
    cmd = [
        sys.executable, "-m", "tokenmill.cli", "serve", str(tiny_model_dir("llama")),
        "--port", str(port), "--max-model-len", "256", "--kv-cache-memory", "8MiB",
        "--served-model-name", MODEL_NAME, "--log-stats-interval", "0",
        "--tensor-parallel-size", "2",
    ]  # fmt: skip
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url, log_path, 120)
        ranks = [
            p for p in psutil.Process(proc.pid).children(recursive=True)
            if "tokenmill.worker.distributed" in " ".join(p.cmdline())
        ]  # fmt: skip
        assert len(ranks) == 1
        events: list[str] = []
        with httpx.stream("POST", f"{url}/v1/completions", json=_stream_body(240), timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 2:
                    ranks[0].kill()
                    killed = time.monotonic()
        assert proc.wait(timeout=30) == 1
        assert time.monotonic() - killed < 15
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "engine_error"
    assert "the engine stopped after an error; the server exits" in log_path.read_text()
