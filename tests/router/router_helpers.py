"""Real replicas (``tokenmill serve`` subprocesses on loopback ports) and a router in a thread.

No conftest here: tests import ``conftest`` by name, and a second one would shadow the root's.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.router.config import RouterConfig
from tokenmill.router.launcher import RouterServer, create_router_server

MODEL_NAME = "tiny-llama"
KEY = "router-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# One thread each: two replicas and the test share 2 cores.
REPLICA_FLAGS = [
    "--max-model-len", "512", "--kv-cache-memory", "8MiB", "--served-model-name", MODEL_NAME,
    "--log-stats-interval", "0", "--num-threads", "1", "--shutdown-timeout", "0",
]  # fmt: skip


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Replica:
    """``tokenmill serve`` in a subprocess; ``kill()`` is a SIGKILL, ``stop()`` a SIGTERM."""

    def __init__(self, model_dir: Path, log_path: Path, *extra: str) -> None:
        self.port = free_port()
        self.log_path = log_path
        cmd = [sys.executable, "-m", "tokenmill.cli", "serve", str(model_dir), *REPLICA_FLAGS,
               "--port", str(self.port), "--api-key", KEY, *extra]  # fmt: skip
        self.log = log_path.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 120.0) -> None:
        wait_healthy(self.url, timeout, self.proc, self.log_path)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def wait_healthy(
    url: str, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode}: {log.read_text() if log else ''}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{url} did not become healthy"
        time.sleep(0.1)


class RouterThread:
    """The router app under uvicorn in a thread of the test process."""

    def __init__(self, replica_urls: list[str], **config: object) -> None:
        config.setdefault("health_interval", 0.2)
        self.config = RouterConfig(
            replica_urls=tuple(replica_urls), port=free_port(), api_keys=(KEY,), **config
        )
        self.server: RouterServer = create_router_server(self.config, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, name="router", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config.port}"

    @property
    def replicas(self):
        return self.server.config.app.state.replicas

    def start(self) -> RouterThread:
        self.thread.start()
        wait_healthy(self.url, 30)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()


def scrape(url: str) -> dict[str, float]:
    """/metrics as {"name{label=value,...}": value}, labels sorted, model_name/engine dropped."""
    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in ("model_name", "engine")}
            key = sample.name + (
                "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"
                if labels
                else ""
            )
            out[key] = sample.value
    return out


def start_replicas(model_dir: Path, tmp: Path, count: int, *extra: str) -> list[Replica]:
    replicas = [Replica(model_dir, tmp / f"replica{i}.log", *extra) for i in range(count)]
    try:
        for r in replicas:
            r.wait_ready()
    except BaseException:
        for r in replicas:
            r.stop()
        raise
    return replicas


class AppThread:
    """Any ASGI app under uvicorn in a thread (an upstream with chosen answers)."""

    def __init__(self, app) -> None:
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> AppThread:
        self.thread.start()
        wait_healthy(self.url, 30)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
