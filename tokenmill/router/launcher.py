"""Running the router, alone (``tokenmill router``) or over local replicas it launches
(``tokenmill serve --data-parallel-size N``).

With N local replicas, each is a ``tokenmill serve`` subprocess with the parent's own
arguments on 127.0.0.1:P+1..P+N, and the router listens on P. A replica that exits is logged
and shown by the router's /health (``exit_status``); when all have exited the parent exits 1.
SIGTERM (or SIGINT) to the parent goes on to every replica, which drains as a lone server
does, and the parent waits for them (killing any left after their shutdown timeout + 15 s).
On Linux each replica also gets SIGTERM if the parent dies without cleaning up.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
from starlette.types import ASGIApp

from tokenmill.router.app import create_app
from tokenmill.router.config import RouterConfig
from tokenmill.router.processes import die_with_parent, wait_or_kill
from tokenmill.router.replicas import ReplicaSet

logger = logging.getLogger(__name__)


class RouterServer(uvicorn.Server):
    """uvicorn.Server that calls ``on_signal`` on SIGTERM / SIGINT and exits 0 after them."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None] | None = None):
        super().__init__(config)
        self.on_signal = on_signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Unlike uvicorn's, this does not re-raise the signal once shut down (exit status 0).
        if self.on_signal is not None:
            self.on_signal()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True


def create_router_server(
    config: RouterConfig,
    replicas: ReplicaSet | None = None,
    log_level: str = "info",
    on_signal: Callable[[], None] | None = None,
) -> RouterServer:
    app = create_app(config, replicas)
    return light_server(app, config.host, config.port, log_level, config.access_log, on_signal)


def light_server(
    app: ASGIApp,
    host: str,
    port: int,
    log_level: str,
    access_log: bool,
    on_signal: Callable[[], None] | None = None,
    graceful_timeout: float | None = None,
) -> RouterServer:
    """A uvicorn server for a light process in front of servers (the router, the host)."""
    # httpx logs every request at INFO: one line per proxied request and health check.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    uv_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        log_level=log_level,
        access_log=access_log,
        lifespan="on",
        timeout_graceful_shutdown=None if graceful_timeout is None else int(graceful_timeout),
    )
    return RouterServer(uv_config, on_signal)


def run_router(config: RouterConfig, log_level: str = "info") -> int:
    """Serve until SIGTERM / SIGINT; returns the exit status."""
    server = create_router_server(config, log_level=log_level)
    logger.info(
        "router at http://%s:%d/v1 over %d replicas: %s",
        config.host, config.port, len(config.replica_urls), ", ".join(config.replica_urls),
    )  # fmt: skip
    server.run()
    return 0


def replica_argv(serve_argv: list[str], port: int, num_threads: int | None) -> list[str]:
    """A replica's command: the parent's ``serve`` arguments, later flags overriding theirs."""
    argv = [sys.executable, "-m", "tokenmill.cli", *serve_argv]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--data-parallel-size", "1"]
    if num_threads is not None:
        argv += ["--num-threads", str(num_threads)]
    return argv


class ReplicaProcesses:
    """The launched replicas: start, watch (exits reach the ReplicaSet), stop."""

    def __init__(self, argvs: list[list[str]], replicas: ReplicaSet, stop_timeout: float):
        self.argvs = argvs
        self.replicas = replicas
        self.stop_timeout = stop_timeout
        self.procs: list[subprocess.Popen] = []
        self.stopping = False
        self.all_exited = threading.Event()

    def start(self) -> None:
        for argv in self.argvs:
            self.procs.append(subprocess.Popen(argv, preexec_fn=die_with_parent))
        for proc, replica in zip(self.procs, self.replicas.replicas, strict=True):
            logger.info("replica %s: pid %d", replica.url, proc.pid)
        threading.Thread(target=self._watch, name="replica-watch", daemon=True).start()

    def _watch(self) -> None:
        while True:
            for idx, proc in enumerate(self.procs):
                status = proc.poll()
                replica = self.replicas[idx]
                if status is not None and replica.exit_status is None:
                    replica.exit_status = status
                    replica.healthy = False
                    replica.last_error = f"its process exited with status {status}"
                    if not self.stopping:
                        logger.error(
                            "replica %s (pid %d) exited with status %d",
                            replica.url, proc.pid, status,
                        )  # fmt: skip
            if all(p.poll() is not None for p in self.procs):
                self.all_exited.set()
                return
            time.sleep(0.2)

    def terminate(self) -> None:
        """SIGTERM to every replica still running (they drain)."""
        self.stopping = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def wait(self) -> None:
        deadline = time.monotonic() + self.stop_timeout
        for proc in self.procs:
            wait_or_kill(proc, max(deadline - time.monotonic(), 0.1), "replica")


def run_data_parallel(
    serve_argv: list[str],
    num_replicas: int,
    router: RouterConfig,
    shutdown_timeout: float,
    num_threads: int | None,
    log_level: str = "info",
) -> int:
    """N replicas of ``tokenmill serve`` on ports ``router.port``+1.. behind the router.

    ``router.replica_urls`` is replaced by the replicas' URLs.
    """
    if router.port == 0:
        raise ValueError("--data-parallel-size needs a fixed --port (replicas take the next)")
    ports = [router.port + 1 + i for i in range(num_replicas)]
    if ports[-1] > 65535:
        raise ValueError(f"--port {router.port} leaves no room for {num_replicas} replicas")
    urls = tuple(f"http://127.0.0.1:{port}" for port in ports)
    config = dataclasses.replace(router, replica_urls=urls, health_interval=1.0)
    replicas = ReplicaSet.from_urls(list(urls))
    if num_threads is None:  # split the cores rather than oversubscribe them N times
        num_threads = max(1, (os.cpu_count() or 1) // num_replicas)
    procs = ReplicaProcesses(
        [replica_argv(serve_argv, port, num_threads) for port in ports],
        replicas,
        stop_timeout=shutdown_timeout + 15,
    )
    server = create_router_server(config, replicas, log_level, on_signal=procs.terminate)
    procs.start()

    def stop_when_all_exit() -> None:
        procs.all_exited.wait()
        if not procs.stopping:
            logger.error("every replica has exited: stopping the router")
            server.should_exit = True

    threading.Thread(target=stop_when_all_exit, name="replica-exits", daemon=True).start()
    logger.info(
        "router at http://%s:%d/v1 over %d local replicas (ports %d-%d)",
        config.host, config.port, num_replicas, ports[0], ports[-1],
    )  # fmt: skip
    try:
        server.run()
    finally:
        failed = procs.all_exited.is_set() and not procs.stopping
        procs.terminate()
        procs.wait()
    return 1 if failed else 0
