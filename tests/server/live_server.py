"""A real tokenmill server on a free loopback port, run by uvicorn in a thread, for the tests.

Each test module starts its own (the tiny model loads in well under a second). No conftest here:
tests import ``conftest`` by name, and a second conftest module would shadow the root one.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.config import EngineArgs
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.server.api import create_app
from tokenmill.server.config import ServerConfig
from tokenmill.server.launcher import TokenmillServer
from tokenmill.server.state import ServerState

MODEL_NAME = "tiny-llama"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tiny_engine_args(model_dir: Path, **overrides: Any) -> EngineArgs:
    kwargs: dict[str, Any] = dict(
        model=str(model_dir), max_model_len=256, kv_cache_memory="8MiB", max_num_seqs=32
    )
    kwargs.update(overrides)
    return EngineArgs(**kwargs)


class LiveServer:
    """Start with ``start()``; ``url`` is the base URL; ``stop()`` shuts down as SIGTERM does."""

    def __init__(
        self,
        load_engine: Callable[[], AsyncEngine],
        **config: Any,
    ) -> None:
        config.setdefault("served_model_name", MODEL_NAME)
        config.setdefault("log_stats_interval", 0)
        self.config = ServerConfig(host="127.0.0.1", port=free_port(), **config)
        self.app = create_app(self.config, load_engine)
        self.server = TokenmillServer(self.app, self.config, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config.port}"

    @property
    def state(self) -> ServerState:
        return self.app.state.services.state

    @property
    def engine(self) -> AsyncEngine:
        assert self.state.engine is not None
        return self.state.engine

    def start(self, wait_ready: bool = True, timeout: float = 60.0) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            assert self.thread.is_alive(), "the server thread died while starting"
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        if wait_ready:
            self.wait_ready(deadline - time.monotonic())
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while httpx.get(f"{self.url}/health").status_code != 200:
            assert time.monotonic() < deadline, "the model did not load"
            time.sleep(0.02)

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the server did not stop"

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Wait until the engine holds no request, every KV block is free and every admission
        ticket is back (a handler releases its ticket after the last byte is sent, so a client
        can read ``[DONE]`` a moment before the count drops)."""
        deadline = time.monotonic() + timeout
        llm = self.engine.engine
        while True:
            stats = self.engine.stats
            if (
                stats.num_running == 0
                and stats.num_waiting == 0
                and self.engine.num_unfinished == 0
                and llm.num_free_blocks == llm.num_total_blocks
                and self.state.num_admitted == 0
            ):
                return
            assert time.monotonic() < deadline, (
                f"engine not idle: {stats}, {self.state.num_admitted} admitted"
            )
            time.sleep(0.02)


@contextlib.contextmanager
def running_server(model_dir: Path, engine_overrides: dict[str, Any] | None = None, **config: Any):
    args = tiny_engine_args(model_dir, **(engine_overrides or {}))
    server = LiveServer(lambda: AsyncEngine.from_args(args), **config).start()
    try:
        yield server
    finally:
        server.stop()


def scrape(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """/metrics as {"name{label=value,...}": value}, labels sorted, model_name/engine dropped."""
    text = httpx.get(f"{url}/metrics", headers=headers).text
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


def sse_events(lines: Iterator[str]) -> Iterator[str]:
    """The data payloads of an SSE stream, [DONE] included."""
    for line in lines:
        if line.startswith("data: "):
            yield line[len("data: ") :]
