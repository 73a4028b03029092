"""OpenAI-compatible HTTP server: FastAPI app, SSE streaming, API keys, Prometheus metrics.

``create_app`` and ``run_server`` are imported lazily, so the CLI can read ``ServerConfig``
without loading FastAPI.
"""

from __future__ import annotations

from typing import Any

from tokenmill.server.config import ServerConfig

__all__ = ["ServerConfig", "create_app", "run_server"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from tokenmill.server.api import create_app

        return create_app
    if name == "run_server":
        from tokenmill.server.launcher import run_server

        return run_server
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
