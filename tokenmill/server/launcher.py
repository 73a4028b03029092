"""Running the app under uvicorn with tokenmill's shutdown: drain, abort the rest, exit 0.

On SIGTERM (or SIGINT) uvicorn stops listening and waits for open connections; before that
wait, ``TokenmillServer.shutdown`` starts the drain, which lets in-flight requests finish for
up to ``shutdown_timeout`` seconds and then aborts the rest, so the wait ends. Requests that
arrive on open connections meanwhile get 503.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from tokenmill.config import EngineArgs
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.memory import settle_heap
from tokenmill.server.api import create_app
from tokenmill.server.config import ServerConfig
from tokenmill.server.state import ServerState

logger = logging.getLogger(__name__)


class TokenmillServer(uvicorn.Server):
    """uvicorn.Server that drains the engine when it shuts down and exits 0 on SIGTERM."""

    def __init__(self, app: FastAPI, config: ServerConfig, log_level: str = "info") -> None:
        super().__init__(
            uvicorn.Config(
                app,
                host=config.host,
                port=config.port,
                log_config=None,
                log_level=log_level,
                access_log=config.access_log,
                lifespan="on",
                # A backstop only: the drain aborts what is left after shutdown_timeout.
                timeout_graceful_shutdown=int(config.shutdown_timeout) + 15,
            )
        )
        self.state: ServerState = app.state.services.state
        self.shutdown_timeout = config.shutdown_timeout
        self.state.on_failed = self.request_exit

    def request_exit(self) -> None:
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.state.begin_drain(self.shutdown_timeout)
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Unlike uvicorn's, this does not re-raise the signal after shutdown: a drained
        # SIGTERM is a clean exit (status 0).
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


def run_server(engine_args: EngineArgs, config: ServerConfig, log_level: str = "info") -> int:
    """Serve until SIGTERM / SIGINT; returns the exit status (1 when the model fails to load
    or the engine stops after an error: the server exits then, for a supervisor to restart)."""
    app = create_app(config, lambda: _load_engine(engine_args))
    server = TokenmillServer(app, config, log_level)
    server.run()
    state: ServerState = app.state.services.state
    return state.exit_status


def _load_engine(engine_args: EngineArgs) -> AsyncEngine:
    engine = AsyncEngine.from_args(engine_args)
    settle_heap()  # what loading made lives as long as the server
    return engine
